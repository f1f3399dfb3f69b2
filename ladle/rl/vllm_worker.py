"""The weights' way into a vLLM engine of its own process: GRPO's separated placement with
`grpo.engine: vllm` (ladle/rl/separated.py). vLLM runs on each engine rank in an engine process
of its own (its own torch.distributed world, so the job's world stays the trainer's and the
engine ranks' alone), and its worker takes the policy's weights straight from the paired trainer
rank over a private two-rank gloo group, as trl's server mode does with its own communicator:

    trainer rank i:  stream_hf(policy) -> send_hf(group, pairs)     (one tensor at a time)
    vLLM's worker:   ladle_receive() -> reload_weights(those pairs)   (as they arrive)

`WeightReceiver` is mixed into vLLM's worker (`worker_extension_cls`); its methods are called by
`LLM.collective_rpc`. On the wire, each tensor is a length, its description as JSON (name,
shape, dtype: nothing is unpickled) and its bytes; a length of 0 ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

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


class WeightReceiver:
    """Mixed into vLLM's worker: joins the trainer rank's private group and reloads the weights
    it streams (the worker's `reload_weights`, which also redoes a backend's post-load packing)."""

    def ladle_connect(self, host: str, port: int) -> None:
        self.ladle_group = private_group(host, port, 1)

    def ladle_receive(self) -> None:
        self.reload_weights(weights_iterator=receive_hf(self.ladle_group))
