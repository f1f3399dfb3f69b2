"""GRPO's separated placement (`grpo.placement: separated`): half the ranks train the policy, the
other half hold a copy of it that only generates (the engine), each half laid out by
`parallel.*`, rank i of one paired with rank i of the other (ladle/parallel/mesh.py's `role`).

Both halves run the shared loop step for step (their checkpoints, signals and bad-step verdicts
agree, as in PPO's separated placement). At the start of each step the trainer's rank sends its
partner the policy's new weights, rank to rank and tensor by tensor in the training layout
(FSDP and TP shards as they lie, since both halves are laid out alike; after the first sync only
the trainable ones: a LoRA run sends its adapters), and the prompts of the batches the engine is
to generate in that step; then it trains while the engine generates, and takes the rollouts at
the end of the step:

    trainer (EngineClient):  weights, prompts, "end"  ->  train  ->  rollouts  <-
    engine  (EngineSide):    receive                  ->  generate ->  send

`grpo.max_staleness: K` decides which batches a step generates: the batch trained from step s is
generated in step s - K (the first step after a start or a resume generates every batch due
before it), so its responses come from weights K updates old at most, and with K = 0 every batch
is generated, from the current weights, before it is trained on: the synchronous loop, and the
same rollouts as the shared placement. Each row carries the version (the trainer's optimizer
step) of the weights it was sampled with; `staleness_mean` and `staleness_max` are logged.

With `grpo.engine: vllm` the engine rank's vLLM runs in a process of its own and its worker
takes the weights, in Hugging Face names, from the trainer rank itself (ladle/rl/vllm_worker.py).

Objects travel pickled through point-to-point sends (placement.Pair), the weights as tensors on
the device. The engine's side receives every message of a step before it generates, so no send
waits on one that waits on it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import torch
import torch.distributed as tdist
from torch.distributed.fsdp import FSDPModule

from ladle.models.stream import stream_hf
from ladle.rl.engine import RolloutEngine
from ladle.rl.loader import VALIDATION_STEP, prompt_lists
from ladle.rl.placement import Pair
from ladle.rl.rollout import Rollouts
from ladle.rl.vllm_worker import host_store, private_group, send_hf
from ladle.train.loop import StepResult, Trainer

ENGINE = 1  # the role of the engine's group (the trainer's: 0, which holds global rank 0)


def shards(model: torch.nn.Module, everything: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor) of each parameter the sync sends: the trainable ones, or
    `everything` (a first sync: the engine's copy holds no trained weights yet). FSDP keeps the
    root's parameters gathered after a forward without backward (generation, validation): they
    are sharded again first, so both sides hold their layout's shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    out = []
    for name, p in model.named_parameters():
        if everything or p.requires_grad:
            out.append((name, p.to_local() if hasattr(p, "to_local") else p))
    return out


def address() -> str:
    """Where the engine rank's worker reaches this rank: the loopback when the job is on one
    machine, else this host's name."""
    if os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1"):
        return "127.0.0.1"
    return socket.getfqdn()


class Ahead:
    """The prompt loader read ahead: the engine's client reads the batches the engine generates
    early (`read`), the rollout loader takes them in order (`next`). Its position (`state_dict`)
    is that of the next batch handed out, so a checkpoint resumes with the batches not yet
    trained on, which the engine then generates again."""

    def __init__(self, inner):
        self.inner = inner
        self.held: dict[int, tuple] = {}  # batch number -> (state before it, microbatches, data_s, samples)
        self.next_b = self.read_b = inner.consumed_samples // max(inner.global_batch, 1)
        self.data_s = 0.0
        self._samples = None

    @property
    def global_batch(self) -> int:
        return self.inner.global_batch

    @property
    def consumed_samples(self) -> int:  # the rollout loader keys its batch by it
        return self.next_b * self.inner.global_batch

    def read(self) -> tuple[int, list[dict]]:
        """The next batch's prompt microbatches from the loader, kept until `next` hands them out."""
        state = self.inner.state_dict()
        micro = self.inner.next()
        b, self.read_b = self.read_b, self.read_b + 1
        samples = self.inner.batch_samples() if hasattr(self.inner, "batch_samples") else None
        self.held[b] = (state, micro, self.inner.data_s, samples)
        return b, micro

    def next(self) -> list[dict]:
        _, micro, self.data_s, self._samples = self.held.pop(self.next_b)
        self.next_b += 1
        return micro

    def batch_samples(self) -> dict | None:
        return self._samples

    def state_dict(self) -> dict:
        return self.held[self.next_b][0] if self.next_b in self.held else self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.held.clear()
        self.next_b = self.read_b = self.inner.consumed_samples // max(self.inner.global_batch, 1)

    def close(self) -> None:
        self.inner.close()


class EngineClient(RolloutEngine):
    """The trainer's side: the engine on the partner rank, behind the rollout engine's interface.
    `begin()` (each step, before its batch is read) sends the weights and the prompts of the
    batches due; `generate` hands out their rollouts; `finish()` (the step's end) takes the ones
    generated while the step trained. `reuse`: steps per batch; `staleness`: `max_staleness`."""

    copies_weights = True

    def __init__(
        self,
        pair: Pair,
        model: torch.nn.Module,
        prompts: Ahead,
        *,
        reuse: int,
        staleness: int,
        max_steps: int,
        exit_at_step: int = 0,
        hf=None,
    ):
        self.pair, self.model, self.prompts = pair, model, prompts
        self.reuse, self.staleness = reuse, staleness
        self.max_steps, self.exit_at_step = max_steps, exit_at_step  # the run's end (train.*)
        self.hf = hf  # (model config, dtype): a vLLM engine, fed the policy in HF names
        self.group = None  # the private group to its worker
        self.clock = lambda: 0  # the trainer's optimizer step (LinkedTrainer sets it)
        self.wait_s = self.send_s = 0.0
        self.steps = 0  # steps since the last `metrics()`
        self.ages: list[int] = []  # the staleness of the rows handed out since then
        self.reset()

    def reset(self) -> None:
        """A (re)start: nothing generated, the engine's copy to be filled whole."""
        self.t = 0  # steps begun since the (re)start
        self.due = 0  # batches asked for since the (re)start
        self.engine_version: int | None = None
        self.waiting: list[tuple[int, int, int]] = []  # (batch, first prompt index, version) in send order
        self.ready: dict[tuple[int, int], Rollouts] = {}

    def mark_stale(self) -> None:  # the loader's load_state_dict: a resume or rollback
        self.reset()

    def send_weights(self) -> None:
        version = self.clock()
        if self.engine_version == version:
            return
        t0 = time.perf_counter()
        if self.hf is not None:
            self.stream_hf(version)
        else:
            self.send_shards(version)
        self.engine_version = version
        self.send_s += time.perf_counter() - t0

    def stream_hf(self, version: int) -> None:
        """To vLLM's worker on the partner rank: every tensor in HF names, gathered from the
        layout's shards one at a time, LoRA merged (`stream_hf`), over a private group."""
        connect = None
        if self.group is None:
            store = host_store()
            connect = (address(), store.port)
        self.pair.send(("weights", version, {"connect": connect}))
        if self.group is None:
            self.group = private_group(None, None, 0, store=store)
        send_hf(self.group, stream_hf(self.model, self.hf[0], self.hf[1], untie=True))

    def send_shards(self, version: int) -> None:
        full = self.engine_version is None
        named = shards(self.model, full)
        described = [(n, tuple(t.shape)) for n, t in named]  # the engine checks its copy against them
        self.pair.send(("weights", version, described if full else len(named)))
        for _, t in named:
            tdist.send(t.detach().contiguous(), dst=self.pair.partner)

    def request(self, key: int, micro: list[dict]) -> None:
        for b in micro:
            prompts, index = prompt_lists(b)
            self.pair.send(("generate", key, prompts, index))
            self.waiting.append((key, index[0], self.clock()))

    def begin(self) -> None:
        last = (self.t + self.staleness) // self.reuse  # the last batch (since the start) due by now
        start = self.clock() - self.t  # the trainer's step at the (re)start
        end = self.max_steps  # and the step it stops at: no batch is asked for that it will not train
        if self.exit_at_step:  # (the loop checks it after a step: one step at least)
            end = min(end, max(self.exit_at_step, start + 1))
        last = min(last, (end - 1 - start) // self.reuse)
        batches = []
        while self.due <= last:
            batches.append(self.prompts.read())
            self.due += 1
        if batches:
            self.send_weights()
            for b, micro in batches:
                self.request(b, micro)
        self.pair.send(("end",))
        if self.t % self.reuse == 0 and self.t // self.reuse >= self.due - len(batches):
            self.receive()  # this step's own batch is among them: it waits for the engine
        self.t += 1

    def receive(self) -> None:
        t0 = time.perf_counter()
        for b, first, version in self.waiting:
            r = self.pair.recv()  # Rollouts, or (Rollouts, episodes) of multi-turn episodes
            rollouts = r[0] if isinstance(r, tuple) else r
            rollouts.version = [version] * len(rollouts)
            self.ready[(b, first)] = r
        self.waiting = []
        self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        """The step's end: the rollouts the engine generated meanwhile."""
        self.receive()
        self.steps += 1

    def sync_weights(self) -> float:
        spent, self.send_s = self.send_s, 0.0
        return spent

    def generate(self, prompts, prompt_index, sampling, *, step: int) -> Rollouts:
        if step == VALIDATION_STEP:  # held-out prompts: asked for now, from the current weights
            self.send_weights()
            self.pair.send(("generate", step, prompts, prompt_index))
            self.pair.send(("end",))
            return self.pair.recv()
        r = self.ready.pop((step, prompt_index[0]))
        now = self.clock()
        rollouts = r[0] if isinstance(r, tuple) else r
        self.ages += [now - v for v in rollouts.version]
        return r

    def run_episodes(self, episodes, records, index, sampling, *, step: int):
        """The episodes the engine's ranks ran (EngineSide), asked for with the batch's prompts;
        the trainer's `episodes` and `records` stay unused here."""
        return self.generate(None, index, sampling, step=step)

    def validated(self) -> None:
        self.pair.tell("validated")

    def metrics(self) -> dict[str, float]:
        """Since the last call: the staleness of the rows handed out (at their batch's first
        step), and the trainer's wait for the engine's rollouts, in seconds a step."""
        out = {"engine_wait_s": self.wait_s / max(self.steps, 1)}
        if self.ages:
            out.update(staleness_mean=sum(self.ages) / len(self.ages), staleness_max=float(max(self.ages)))
        self.wait_s, self.steps, self.ages = 0.0, 0, []
        return out

    def close(self) -> None:
        self.group = None  # the private group to vLLM's worker (its store goes with it)


class EngineSide:
    """The engine's group: its loader. Each step it takes its partner's messages (the weights
    into its copy, the prompts to generate) up to "end", generates, and sends the rollouts back
    in order; validation likewise until "validated". It trains nothing and reads no data."""

    console = ()

    def __init__(
        self, pair: Pair, engine: RolloutEngine, model: torch.nn.Module, sampling, episodes=None, records=None
    ):
        self.pair, self.engine, self.model, self.sampling = pair, engine, model, sampling
        # multi-turn episodes (ladle/rl/env.py) run here, the environments and tools beside the
        # engine; `records`: the prompts' records by split, which the environments start from
        self.episodes, self.records = episodes, records
        self.data_s = self.gen_s = 0.0

    def serve(self) -> str:
        """One round: messages up to "end" or "validated" (returned), then the rollouts asked for."""
        asked = []
        while True:
            msg = self.pair.recv()
            if msg[0] == "weights":
                self.receive_weights(msg[1], msg[2])
            elif msg[0] == "generate":
                asked.append(msg[1:])
            else:
                kind = msg[1] if msg[0] == "tell" else msg[0]
                break
        # all generated before any is sent: a send waits for the trainer's receive, at its step's end
        done = [self.generate(step, prompts, index) for step, prompts, index in asked]
        for r in done:
            self.pair.send(r)
        return kind

    def generate(self, step: int, prompts, index):
        """The rollouts asked for: responses, or (Rollouts, episodes) of multi-turn episodes."""
        if self.episodes is None:
            return self.engine.generate(prompts, index, self.sampling, step=step)
        split = "val" if step == VALIDATION_STEP else "train"
        return self.episodes.run(self.engine, self.records[split], index, self.sampling, step=step)

    @torch.no_grad()
    def receive_weights(self, version: int, names) -> None:
        if isinstance(names, dict):  # vLLM: its worker takes them from the trainer rank itself
            if names["connect"] is not None:
                self.engine.connect(*names["connect"])
            self.engine.receive()
            return
        full = isinstance(names, list)
        named = shards(self.model, full)
        mine = [(n, tuple(t.shape)) for n, t in named]
        if full and names != mine:
            diff = next((a, b) for a, b in zip(names + [None], mine + [None], strict=False) if a != b)
            raise RuntimeError(
                f"separated placement: the trainer's policy and the engine's copy differ in their parameters "
                f"(trainer {diff[0]}, engine {diff[1]}: name and shape of this rank's shard)"
            )
        if not full and names != len(named):
            raise RuntimeError(
                f"separated placement: {names} trainable tensors sent, the engine has {len(named)}"
            )
        for _, t in named:
            buf = torch.empty_like(t)
            tdist.recv(buf, src=self.pair.partner)
            t.copy_(buf)

    def next(self) -> list[dict]:
        return []  # the step's work is EngineTrainer.train_step's, beside the trainer's

    def validate(self, batches) -> dict:
        while self.serve() != "validated":
            pass
        return {}  # the trainer's ranks log validation

    def state_dict(self) -> dict:
        return {}  # the prompts' position is the trainer's (rank 0 writes the trainer state)

    def load_state_dict(self, state: dict) -> None:
        pass  # the partner's client starts over with a whole sync

    def step_metrics(self) -> dict:
        return {}

    def close(self) -> None:
        self.engine.close()
        if self.episodes is not None:
            self.episodes.close()


class LinkedTrainer(Trainer):
    """The shared loop on the trainer's group: its step, then the rollouts generated meanwhile
    (`EngineClient.finish`), then its record to the engine's partner (so both count the same
    bad steps, stop and checkpoint alike)."""

    def __init__(self, *args, pair: Pair, client: EngineClient, **kw):
        super().__init__(*args, **kw)
        self.pair, self.client = pair, client
        client.clock = lambda: self.step

    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> StepResult:
        out = super().train_step(micro)
        self.client.finish()
        self.pair.swap(dataclasses.replace(out, local=None))
        return out


class EngineTrainer(Trainer):
    """The shared loop on the engine's group: a step serves the partner's requests while it
    trains, then takes its record. Nothing of it is checkpointed: the engine's copy is refilled
    from the trainer after a resume."""

    def __init__(self, *args, pair: Pair, **kw):
        super().__init__(*args, name="engine", **kw)
        self.pair = pair
        self.parts = {}

    def train_step(self, micro) -> StepResult:
        t0 = time.perf_counter()
        self.loader.serve()
        self.loader.gen_s = time.perf_counter() - t0
        return self.pair.swap(None)
