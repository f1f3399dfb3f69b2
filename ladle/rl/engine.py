"""Where rollouts come from: prompts + sampling settings + the policy's current weights -> responses
with the log-probs they were sampled with. The RL recipes ask a `RolloutEngine` and nothing else,
so another engine (an inference server with its own copy of the weights) can stand behind the
same two calls: `sync_weights()` before a batch is generated (the trained weights reach the
engine), `generate(...)` for the responses.

`LocalEngine` samples with the training model itself, laid out as it trains (FSDP, TP), inside
the training processes (ladle/rl/rollout.py `rollout`): its weights are always current.
`VLLMEngine` (ladle/rl/vllm.py) holds its own copy, which follows the policy's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ladle.rl.rollout import Rollouts, Sampling, rollout


class RolloutEngine:
    """The interface of a rollout engine. `copies_weights`: it samples from its own copy of the
    weights, which `sync_weights` brings up to date (its seconds logged as `weight_sync_s`)."""

    copies_weights = False

    def sync_weights(self) -> float:
        """Make the policy's current weights the ones `generate` samples with; the seconds spent."""
        raise NotImplementedError

    def mark_stale(self) -> None:
        """The policy's weights changed outside an optimizer step (a state load)."""

    def begin(self) -> None:
        """A training step is about to take its batch (an engine that generates ahead asks for
        its next batches here: ladle/rl/separated.py)."""

    def metrics(self) -> dict[str, float]:
        """The engine's own figures for the step's record."""
        return {}

    def close(self) -> None:
        """Release the engine."""

    def generate(
        self, prompts: list[list[int]], prompt_index: list[int], sampling: Sampling, *, step: int
    ) -> Rollouts:
        """`sampling.n` responses to each prompt (token ids), in prompt order, each with its
        sampling log-probs. `prompt_index` (global indices) and `step` key the random streams,
        so a response does not depend on the batch or layout it was sampled in."""
        raise NotImplementedError

    def generate_rows(
        self,
        contexts: list[list[int]],
        keys: list[tuple[int, int, int]],
        limits: list[int],
        sampling: Sampling,
        *,
        step: int,
    ) -> Rollouts:
        """One response to each context (an episode's transcript so far: ladle/rl/env.py), its
        random stream keyed by (prompt index, sample, turn) and `step`, of `limits` tokens at
        most; `sampling.n` is not used."""
        raise NotImplementedError(f"{type(self).__name__} does not run multi-turn episodes")

    def idle(self) -> None:
        """The batch's generation is over (after an episode's last turn): an engine may release
        its memory until the next sync."""

    def run_episodes(self, episodes, records: list[dict], index: list[int], sampling: Sampling, *, step: int):
        """Multi-turn episodes of the prompts `index` (ladle/rl/env.py `Episodes`), turn by turn
        on this engine: (Rollouts, episodes). A separated engine runs them on its own ranks."""
        return episodes.run(self, records, index, sampling, step=step)


class LocalEngine(RolloutEngine):
    """Samples with the training model in the training processes. `context`: the training
    forward's numerics (autocast; loss-parallel under TP), so sampling log-probs match the
    loss's; `group`: the ranks of the model's layout, which generate in step; `routing`: an MoE
    policy's routing is recorded with each row (routing replay)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        seed: int,
        end_ids: set[int],
        decode: Callable[[list[int]], str],
        pad_id: int,
        batch_size: int,
        group=None,
        seq_multiple: int = 1,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        routing: bool = False,
    ):
        # DDP's wrapper adds nothing to a forward without gradients, and hides the model's KV cache
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        self.seed, self.end_ids, self.decode = seed, end_ids, decode
        self.pad_id, self.batch_size, self.group, self.seq_multiple = pad_id, batch_size, group, seq_multiple
        self.context, self.routing = context, routing  # routing: an MoE policy's, recorded for replay

    def sync_weights(self) -> float:
        return 0.0  # the model it samples with is the one being trained

    def generate(self, prompts, prompt_index, sampling: Sampling, *, step: int) -> Rollouts:
        return self._rollout(prompts, prompt_index, sampling, step)

    def generate_rows(self, contexts, keys, limits, sampling: Sampling, *, step: int) -> Rollouts:
        return self._rollout(contexts, None, sampling, step, keys=keys, limits=limits)

    def _rollout(self, prompts, prompt_index, sampling: Sampling, step: int, **rows) -> Rollouts:
        with self.context():
            return rollout(
                self.model,
                prompts,
                prompt_index,
                sampling,
                seed=self.seed,
                step=step,
                end_ids=self.end_ids,
                decode=self.decode,
                pad_id=self.pad_id,
                batch_size=self.batch_size,
                group=self.group,
                seq_multiple=self.seq_multiple,
                routing=self.routing,
                **rows,
            )
