"""The vLLM rollout engine (`grpo.engine: vllm`, `ppo.engine: vllm`): responses sampled by vLLM's
offline engine, which brings paged KV memory, continuous batching, prefix caching across a
prompt's samples and (on accelerators) graph capture. One code path: vLLM on CUDA, vLLM-Ascend
on an NPU, vLLM's CPU build on a CPU.

Placement: colocated. Each training process holds its own engine, inside the process (vLLM's
`external_launcher` executor, as trl's colocate mode and verl's hybrid engine run it), of tensor
parallel degree 1: the data-parallel ranks each generate their own prompts, as with ladle's
engine. The engine starts from the policy's config alone (`load_format: dummy`) and gets every
weight from the policy before it first samples. Or separated (GRPO's `placement: separated`):
vLLM on each engine rank in an engine process of its own, fed by the paired trainer rank
(ladle/rl/vllm_worker.py, ladle/rl/separated.py).

Weights that follow the policy: after an optimizer step (or a state load: resume, rollback) the
next `sync_weights` streams the policy's weights to the engine in Hugging Face names, one tensor
at a time, each gathered from its FSDP / TP shards when its turn comes and LoRA adapters merged on
the fly (ladle/models/stream.py `stream_hf`), into the worker's `reload_weights`, which also
redoes a backend's post-load packing (ladle/rl/vllm_worker.py `ladle_reload`, which also packs
the CPU MoE kernel's experts, left unpacked by vLLM), and empties the prefix cache, whose blocks
were computed with the old weights. No rank holds a second whole copy of the model. The time is
logged as `weight_sync_s`.

Sampling: one request per (prompt, sample), seeded from the same key as ladle's own streams
(ladle/rl/rollout.py `row_seed`), so a response depends on its key, not on its batch; the
responses of one prompt share its prefill through the prefix cache. Log-probs are vLLM's
"processed" ones, of softmax(logits / T) after top-k / top-p, the trainer's when neither filter
is set; the rollout correction (ladle/rl/algorithms.py) covers what differs. Stop strings are
cut here, after generation (the engine runs without a tokenizer).

Routing (an MoE policy's, for `routing_agreement` and routing replay): the worker records the
experts of every token it computes (ladle/rl/vllm_worker.py `RoutingRecorder`, on vLLM's V1
model runner, which the engine then starts with); the positions the prefix cache served are
filled from the row that computed their block (`Blocks`), whose computation they are. Each row's
routing covers the tokens it read: its prompt and every response token but the last.

With `enable_sleep_mode` in `engine_args` (accelerators), the engine releases its memory
(weights and KV cache, level 2) after generating and takes it back before the next sync, so the
training step has the device to itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from ladle import distributed as dist
from ladle.config.schema import ModelConfig
from ladle.errors import ConfigError
from ladle.models.generation import stop_strings
from ladle.models.hf import hf_config
from ladle.models.hf.families import FAMILIES
from ladle.models.stream import stream_hf
from ladle.rl.engine import RolloutEngine
from ladle.rl.rollout import Rollouts, Sampling, row_seed

INSTALL = "pip install 'ladle[vllm]' (in a clone of ladle: make setup-vllm)"
# what ladle sets itself: the engine's model, numerics, seeds and executor follow the run
FIXED = {
    "model",
    "tokenizer",
    "skip_tokenizer_init",
    "load_format",
    "dtype",
    "seed",
    "distributed_executor_backend",
    "worker_extension_cls",
    "logprobs_mode",
}
WORKER = "ladle.rl.vllm_worker.LadleWorker"
NOT_YET = {  # engine layouts other than one engine per training process
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def import_vllm(where: str):
    """vLLM, or a ConfigError (exit 2) with the install line."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{where}=vllm needs vLLM, which is not installed here ({e}); {INSTALL}") from None
    return vllm


def check(section, model: ModelConfig, name: str) -> None:
    """Before launch: vLLM is installed, knows every `engine_args` key (and ladle does not set it
    itself), and can load the policy's architecture."""
    vllm = import_vllm(f"{name}.engine")
    known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    for key, value in section.engine_args.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)  # as the config loader's hints
            hint = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
            raise ConfigError(f"{name}.engine_args.{key}: vLLM has no engine argument {key!r}{hint}")
        if key in FIXED:
            raise ConfigError(
                f"{name}.engine_args.{key}: ladle sets {key} itself (the engine follows the run's "
                "model, precision and seed); remove it"
            )
        if key in NOT_YET and value != NOT_YET[key]:
            raise ConfigError(
                f"{name}.engine_args.{key}={value}: the vLLM engine runs one copy per training process "
                f"(colocated, {key} 1) for now; remove it, and scale with the training layout's ranks"
            )
    arch = FAMILIES[model.family][0]
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if arch not in supported:
        can = sorted(f for f, (a, _) in FAMILIES.items() if a in supported)
        raise ConfigError(
            f"model.family={model.family}: this vLLM cannot load {arch}; {name}.engine=vllm serves the "
            f"families {', '.join(can)} (or set {name}.engine: ladle)"
        )


def visible_only(device: torch.device) -> None:
    """This rank's accelerator the only one processes started from here see (vLLM's engine
    process picks the first it sees)."""
    var = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}.get(device.type)
    if var is None or device.index is None:
        return
    seen = os.environ.get(var)
    ids = seen.split(",") if seen else [str(i) for i in range(torch.accelerator.device_count())]
    os.environ[var] = ids[device.index]


class VLLMEngine(RolloutEngine):
    """vLLM inside this training process, fed the policy's weights (see the module docstring).
    `model`: the policy as it trains (laid out); `optimizer`: its optimizer, whose steps mark the
    engine's copy stale; `max_len`: prompt + response tokens at most; `where`: the config key of
    `engine_args`, for the message when vLLM refuses a value. `separated`: on an engine rank of
    GRPO's separated placement, without the policy: vLLM in an engine process of its own, its
    worker fed by the paired trainer rank (`connect`, `receive`: ladle/rl/vllm_worker.py).
    `routing`: an MoE policy's routing is recorded with each row; `replay`: the run replays it
    (`routing_replay`), so a vLLM that cannot record it is refused, where otherwise the engine
    samples without it and says why in `unrecorded`."""

    copies_weights = True

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        *,
        optimizer,
        seed: int,
        end_ids: set[int],
        decode,
        dtype: torch.dtype,
        max_len: int,
        engine_args: dict,
        device: torch.device,
        where: str = "engine_args",
        separated: bool = False,
        routing: bool = False,
        replay: bool = False,
    ):
        vllm = import_vllm("engine")
        self.routing, self.unrecorded = routing, None
        if routing:  # the worker records it from the V1 model runner's batch layout
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").lower() not in ("0", "false"):
                self.no_routing("VLLM_USE_V2_MODEL_RUNNER is set", replay, where)
            else:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        self.model, self.model_cfg, self.dtype = model, model_cfg, dtype
        self.seed, self.end_ids, self.decode = seed, end_ids, decode
        self.folder = tempfile.mkdtemp(prefix="ladle-vllm-")
        config = hf_config(model_cfg, eos_id=min(end_ids) if end_ids else None, torch_dtype=DTYPES[dtype])
        # a tied head untied in the engine: vLLM's in-place reload leaves a tied head on the weights
        # it had before (the embedding arrives, the head layer gets nothing and keeps the old ones)
        config["tie_word_embeddings"] = False
        with open(os.path.join(self.folder, "config.json"), "w") as f:
            json.dump(config, f)
        if separated:  # an engine process with a torch.distributed world of its own
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            visible_only(device)  # the engine process on this rank's device, not the first one
            where_it_runs = {}
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
            # the executor reads torchrun's variables; a one-process run has none (it joins our group)
            rank, world = dist.rank(), dist.world_size()
            for key, value in (("RANK", rank), ("LOCAL_RANK", dist.local_rank()), ("WORLD_SIZE", world)):
                os.environ.setdefault(key, str(value))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            # in this process, on its process group
            where_it_runs = {"distributed_executor_backend": "external_launcher"}
        args = {
            "enable_prefix_caching": True,
            "enforce_eager": device.type == "cpu",
            "max_model_len": max_len,
            # colocated with training: a share of the device (on a CPU, of its memory for the KV
            # cache); an engine rank's device is the engine's
            **(
                {"kv_cache_memory_bytes": 2**28}
                if device.type == "cpu"
                else {"gpu_memory_utilization": 0.85 if separated else 0.3}
            ),
            # vLLM's CPU sampler cannot rewind a seeded request's generator after a partial prefill
            # ("CPU Generator does not use offset"): whole prompts only
            **({"enable_chunked_prefill": False} if device.type == "cpu" else {}),
            **engine_args,
            "model": self.folder,
            "skip_tokenizer_init": True,
            "load_format": "dummy",  # every weight comes from the policy at the first sync
            "dtype": DTYPES[dtype],
            "seed": seed,
            **where_it_runs,
            "worker_extension_cls": WORKER,
            "logprobs_mode": "processed_logprobs",  # of softmax(logits / T), as the trainer's
        }
        # sleeping gives the training step the device; an engine rank trains nothing on it
        self.sleeps = bool(args.get("enable_sleep_mode")) and not separated
        try:
            self.llm = vllm.LLM(**args)
        except (TypeError, ValueError) as e:  # a value vLLM's config refuses (the keys were checked)
            raise ConfigError(f"{where}: vLLM cannot start with {engine_args}: {e}") from None
        # vLLM tears down the process group it joined when its engine shuts down: at the run's end
        dist.before_shutdown(self.shutdown)
        self.stale, self.asleep = True, False
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.mark_stale())
        self._params, self._prompt = vllm.SamplingParams, vllm.inputs.TokensPrompt
        if self.routing:
            try:
                self.layers = self.llm.collective_rpc("ladle_record_routing")[0]
            except Exception as e:  # a model runner or router this vLLM has otherwise
                self.no_routing(str(e), replay, where)
            self.blocks = Blocks(self.llm.llm_engine.vllm_config.cache_config.block_size)

    def no_routing(self, why: str, replay: bool, where: str) -> None:
        """The routing cannot be recorded: refused if the run replays it, noted otherwise."""
        key = where.rsplit(".", 1)[0] + ".routing_replay"
        if replay:
            raise ConfigError(
                f"{key}: this vLLM's routing cannot be recorded ({why}); set {key}: false, or use "
                "ladle's engine"
            )
        self.routing, self.unrecorded = False, f"the vLLM engine records no routing ({why})"

    def mark_stale(self) -> None:
        """The policy's weights changed (an optimizer step, a state load): sync before sampling."""
        self.stale = True

    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        if self.stale:
            pairs = stream_hf(self.model, self.model_cfg, self.dtype, untie=True)
            self.llm.collective_rpc("ladle_reload", kwargs={"weights_iterator": pairs})
            self.fresh_weights()
        return time.perf_counter() - t0

    def fresh_weights(self) -> None:
        """New weights are in: the prefix cache's blocks hold keys and values of the old ones (a
        prompt's shared chat-template start would be read from them), so it starts empty."""
        self.llm.reset_prefix_cache()
        if self.routing:  # as the prefix cache, the blocks' routing was the old weights'
            self.blocks.clear()
        self.stale = False

    def connect(self, host: str, port: int) -> None:
        """A separated engine: its worker joins the trainer rank's private group."""
        self.llm.collective_rpc("ladle_connect", args=(host, port))

    def receive(self) -> float:
        """A separated engine: the weights the trainer rank streams, into the engine; the seconds."""
        t0 = time.perf_counter()
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        self.llm.collective_rpc("ladle_receive")
        self.fresh_weights()
        return time.perf_counter() - t0

    def generate(self, prompts, prompt_index, sampling: Sampling, *, step: int) -> Rollouts:
        rows = [(p, i, s, 0) for p, i in zip(prompts, prompt_index, strict=True) for s in range(sampling.n)]
        out = self._generate(rows, [sampling.max_new_tokens] * len(rows), sampling, step)
        self.idle()
        return out

    def generate_rows(self, contexts, keys, limits, sampling: Sampling, *, step: int) -> Rollouts:
        # awake between an episode's turns: the episodes' loop calls `idle` after the last
        return self._generate([(c, *k) for c, k in zip(contexts, keys, strict=True)], limits, sampling, step)

    def idle(self) -> None:
        if self.sleeps:  # the training step gets the device back; the weights come again at the sync
            self.llm.sleep(level=2)
            self.asleep, self.stale = True, True

    def _generate(self, rows: list, limits: list[int], sampling: Sampling, step: int) -> Rollouts:
        """One request a row (prompt, prompt index, sample, turn) of its limit's tokens at most."""
        params = [
            self._params(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=n,
                stop_token_ids=sorted(self.end_ids),
                logprobs=0,
                seed=row_seed(self.seed, step, i, s, t),
                detokenize=False,
                extra_args={"ladle_row": k},  # the worker's label of the row's routing
            )
            for k, ((_, i, s, t), n) in enumerate(zip(rows, limits, strict=True))
        ]
        prompts = [self._prompt(prompt_token_ids=list(p)) for p, _, _, _ in rows]
        done = self.llm.generate(prompts, params, use_tqdm=False) if rows else []
        stop = stop_strings(self.decode, list(sampling.stop)) if sampling.stop else None
        out, read = Rollouts(), []
        for (p, i, s, _), result in zip(rows, done, strict=True):
            c = result.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step_lps[t].logprob) for t, step_lps in zip(ids, c.logprobs, strict=True)]
            finished = c.finish_reason == "stop"
            if stop is not None:
                cut = next((k for k in range(1, len(ids) + 1) if stop(ids[:k])), None)
                if cut is not None:
                    ids, lps, finished = ids[:cut], lps[:cut], True
            out.add(i, s, p, ids, lps, finished)
            if self.routing:
                read.append(list(p) + ids[:-1])
        if self.routing:
            out.routing = self.routes(read, self.llm.collective_rpc("ladle_take_routing")[0])
        return out

    def routes(self, read: list[list[int]], recorded: dict) -> list[torch.Tensor]:
        """Each row's routing over the tokens it `read` ((tokens, MoE layers, k) int16): what the
        worker `recorded` for it (`ladle_take_routing`), and the positions the prefix cache
        served, from `blocks`."""
        rows = torch.from_numpy(np.frombuffer(recorded["rows"], dtype=np.int64).copy())
        positions = torch.from_numpy(np.frombuffer(recorded["positions"], dtype=np.int64).copy())
        experts = np.frombuffer(recorded["experts"], dtype=np.int16).copy()
        experts = torch.from_numpy(experts).view(recorded["shape"])
        keep = (rows >= 0) & (rows < len(read))
        rows, positions, experts = rows[keep], positions[keep], experts[keep]
        order = torch.argsort(rows, stable=True)
        counts = torch.bincount(rows, minlength=len(read)).tolist()
        out = []
        for tokens, pos, ex in zip(
            read, positions[order].split(counts), experts[order].split(counts), strict=True
        ):
            rt = torch.full((len(tokens), *self.layers), -1, dtype=torch.int16)
            mine = pos < len(tokens)  # (not the last token's, had it been read)
            rt[pos[mine]] = ex[mine]  # a position computed twice (a preempted row): the same weights
            out.append(rt)
        for tokens, rt in zip(read, out, strict=True):  # every block a row computed whole
            self.blocks.add(tokens, rt)
        for tokens, rt in zip(read, out, strict=True):  # then the blocks a row was served
            self.blocks.fill(tokens, rt)
        return out

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


class Blocks:
    """The routing of prefix-cache blocks computed with the engine's weights: a block is known by
    its tokens and every token before it (a chain of hashes, as vLLM's prefix cache keys it), and
    a row the cache served a block gets the routing of the row that computed it."""

    def __init__(self, size: int):
        self.size, self.known = size, {}

    def clear(self) -> None:
        self.known.clear()

    def _keys(self, tokens: list[int]):
        h = None
        for j in range(len(tokens) // self.size):
            h = hash((h, tuple(tokens[j * self.size : (j + 1) * self.size])))
            yield j * self.size, h

    def add(self, tokens: list[int], routing: torch.Tensor) -> None:
        have = (routing[:, 0, 0] >= 0).tolist()
        for a, h in self._keys(tokens):
            if h not in self.known and all(have[a : a + self.size]):
                self.known[h] = routing[a : a + self.size]

    def fill(self, tokens: list[int], routing: torch.Tensor) -> None:
        have = (routing[:, 0, 0] >= 0).tolist()
        for a, h in self._keys(tokens):
            if not all(have[a : a + self.size]) and h in self.known:
                block = routing[a : a + self.size]
                gap = block[:, 0, 0] < 0
                block[gap] = self.known[h][gap]
