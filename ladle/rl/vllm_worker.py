"""What ladle adds to vLLM's worker (`LadleWorker`, its `worker_extension_cls`; the methods are
called by `LLM.collective_rpc`): the weights' way in from a trainer rank, and an MoE policy's
routing as sampled.

The weights' way into a vLLM engine of its own process: GRPO's separated placement with
`grpo.engine: vllm` (ladle/rl/separated.py). vLLM runs on each engine rank in an engine process
of its own (its own torch.distributed world, so the job's world stays the trainer's and the
engine ranks' alone), and its worker takes the policy's weights straight from the paired trainer
rank over a private two-rank gloo group, as trl's server mode does with its own communicator:

    trainer rank i:  stream_hf(policy) -> send_hf(group, pairs)     (one tensor at a time)
    vLLM's worker:   ladle_receive() -> ladle_reload(those pairs)     (as they arrive)

On the wire, each tensor is a length, its description as JSON (name, shape, dtype: nothing is
unpickled) and its bytes; a length of 0 ends the stream.

Routing (`RoutingRecorder`, for routing replay and `routing_agreement`): every MoE layer's router
hands its top-k expert ids to a callback (vLLM's own hook for its routed-experts capture, which
its Model Runner V2 alone wires up), which copies them into one buffer on the device, rows in
the step's token order; it is a tensor copy, so it is also captured into a CUDA graph. After each
of the model runner's steps the rows are labelled with their request's row (`ladle_row` in its
sampling parameters' `extra_args`) and position, and kept on the host until
`ladle_take_routing` hands them to the engine. Positions the step did not compute (a prompt's start that the prefix cache
served) are the engine's to fill (ladle/rl/vllm.py). This reads the V1 model runner's batch
layout (`input_batch`, `query_start_loc`, `positions`), so the engine starts vLLM with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as tdist

TIMEOUT = timedelta(minutes=30)


def private_group(host: str, port: int, rank: int, store=None):
    """A gloo group of two ranks (0: the trainer's, which hosts the store; 1: vLLM's worker),
    apart from any torch.distributed world of either process."""
    if store is None:
        store = tdist.TCPStore(host, port, 2, is_master=False, timeout=TIMEOUT)
    return tdist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def host_store() -> tdist.TCPStore:
    """The store of a private group, on a free port of this host (its `.port`)."""
    return tdist.TCPStore("0.0.0.0", 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def send_hf(group, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    """(HF name, tensor) pairs to rank 1 of the private `group`, by way of host memory; their count."""
    n = 0
    for name, t in pairs:
        meta = json.dumps(
            {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        )
        raw = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)
        group.send([torch.tensor([raw.numel()], dtype=torch.long)], 1, 0).wait()
        group.send([raw], 1, 0).wait()
        group.send([t.detach().to("cpu").contiguous()], 1, 0).wait()
        n += 1
    group.send([torch.zeros(1, dtype=torch.long)], 1, 0).wait()
    return n


def receive_hf(group) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs `send_hf` sends, as they arrive."""
    while True:
        size = torch.zeros(1, dtype=torch.long)
        group.recv([size], 0, 0).wait()
        if int(size) == 0:
            return
        raw = torch.empty(int(size), dtype=torch.uint8)
        group.recv([raw], 0, 0).wait()
        meta = json.loads(raw.numpy().tobytes().decode())
        t = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
        group.recv([t], 0, 0).wait()
        yield meta["name"], t


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """vLLM's CPU MoE kernel reads its experts' weights prepacked into its own layout, which vLLM
    0.32 does at the first load and not again after an in-place reload (its unquantized MoE
    method sets its experts up on the first call only): the reloaded weights are packed here. How
    many MoE layers were."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU kernels
        return 0
    n = 0
    for m in model.modules():
        experts = getattr(
            getattr(getattr(m, "quant_method", None), "moe_kernel", None), "fused_experts", None
        )
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(m, "w13_weight"):
            experts.process_weights_after_loading(m)
            n += 1
    return n


class WeightReceiver:
    """Mixed into vLLM's worker: reloads the policy's weights in place (`ladle_reload`: the
    worker's `reload_weights`, which also redoes a backend's post-load packing, and the CPU
    experts' packing it misses), streamed by the trainer rank when the engine is separated."""

    def ladle_reload(self, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=weights_iterator)
        repack_cpu_experts(self.model_runner.get_model())

    def ladle_connect(self, host: str, port: int) -> None:
        self.ladle_group = private_group(host, port, 1)

    def ladle_receive(self) -> None:
        self.ladle_reload(receive_hf(self.ladle_group))


class RoutingRecorder:
    """Mixed into vLLM's worker: records the experts each token the model computes is routed to,
    per MoE layer (see the module docstring)."""

    def ladle_record_routing(self) -> tuple[int, int]:
        """Hooks every MoE layer's router and the model runner's step; (MoE layers, k). A
        RuntimeError names what this vLLM's model runner lacks."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = self.model_runner
        lacks = [
            a for a in ("input_batch", "query_start_loc", "positions", "requests") if not hasattr(runner, a)
        ]
        if lacks:
            raise RuntimeError(f"vLLM's model runner {type(runner).__name__} has no {', '.join(lacks)}")
        layers = sorted(
            (m for m in runner.get_model().modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id
        )
        unhooked = [m.layer_id for m in layers if not hasattr(m.router, "set_capture_fn")]
        if not layers or unhooked:
            raise RuntimeError(f"no router to hook in the MoE layers {unhooked or 'of this model'}")
        k = self.vllm_config.model_config.get_num_experts_per_tok()
        buf = torch.full((runner.max_num_tokens, len(layers), k), -1, dtype=torch.int32, device=runner.device)
        for j, m in enumerate(layers):  # j: the MoE layer's ordinal, as ladle's routing counts them

            def capture(ids: torch.Tensor, j: int = j) -> None:
                buf[: ids.shape[0], j] = ids

            m.router.set_capture_fn(capture)
        self.ladle_steps, self.ladle_rows = [], {}
        run = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            out = run(scheduler_output, *args, **kwargs)
            total = scheduler_output.total_num_scheduled_tokens
            if total:
                self.ladle_note_step(runner, buf, total)
            return out

        runner.execute_model = execute_model
        return len(layers), k

    def ladle_note_step(self, runner, buf: torch.Tensor, total: int) -> None:
        """The step's routing rows, labelled by request row and position (its forward is done)."""
        n = runner.input_batch.num_reqs
        rows = []
        for req in runner.input_batch.req_ids[:n]:
            if req not in self.ladle_rows:
                extra = runner.requests[req].sampling_params.extra_args or {}
                self.ladle_rows[req] = extra.get("ladle_row", -1)
            rows.append(self.ladle_rows[req])
        starts = runner.query_start_loc.cpu[: n + 1].numpy()
        if starts[-1] != total:
            raise RuntimeError(f"routing: the step's requests span {starts[-1]} tokens, its batch {total}")
        labels = np.repeat(np.asarray(rows, dtype=np.int64), np.diff(starts))
        # copies: on a CPU, .cpu() would keep views of buffers the next step overwrites
        self.ladle_steps.append(
            (
                labels,
                runner.positions[:total].to("cpu", copy=True),
                buf[:total].to("cpu", torch.int16, copy=True),
            )
        )

    def ladle_take_routing(self) -> dict:
        """The routing recorded since the last take, a computed token each: `rows` (int64), its
        `positions` (int64) and `experts` ((tokens, MoE layers, k) int16, `shape`), in the order
        computed, as bytes (an engine process's results cross to the trainer's by msgpack, which
        keeps bytes as they are and tensors not)."""
        steps, self.ladle_steps, self.ladle_rows = self.ladle_steps, [], {}
        rows = np.concatenate([s[0] for s in steps]) if steps else np.zeros(0, np.int64)
        positions = torch.cat([s[1] for s in steps]) if steps else torch.zeros(0, dtype=torch.long)
        experts = torch.cat([s[2] for s in steps]) if steps else torch.zeros(0, dtype=torch.int16)
        return {
            "rows": rows.tobytes(),
            "positions": positions.numpy().tobytes(),
            "experts": experts.numpy().tobytes(),
            "shape": list(experts.shape),
        }


class LadleWorker(WeightReceiver, RoutingRecorder):
    """ladle's methods on vLLM's worker (`worker_extension_cls`)."""
