"""What a real run holds, measured: the yardstick the planner is tested against (tests/test_plan.py,
bench/gpu_plan_check.py).

- `saved_for_backward`: the bytes autograd keeps for backward during a forward, counted once per
  storage (views share one), parameters left out (they are the model's state, not activations).
- `state_bytes`: the bytes of a model's parameters, their gradients and the optimizer's state on
  this rank, from the tensors themselves (a sharded parameter's local storage, FSDP2's padding
  included).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = _local(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


class SavedTensors:
    """A context in which every tensor autograd saves for backward is counted by its storage.

    `bytes` is the total of distinct storages. Parameters (and their local shards) are excluded,
    as is anything whose storage is empty (FSDP2's resharded weights). Selective activation
    checkpointing keeps the outputs of its chosen ops in a cache of its own, out of autograd's
    sight: `keep_ops` (ladle.parallel.ac._SAVE) counts the outputs of those ops as well."""

    def __init__(self, *models: nn.Module, keep_ops=()):
        self.models = models
        self.params = self._param_storages()
        self.seen: dict[int, int] = {}
        self.keep_ops = set(keep_ops)

    def _param_storages(self) -> set[int]:
        return {_storage(p)[0] for m in self.models for p in m.parameters()}

    def _add(self, t: torch.Tensor):
        ptr, n = _storage(t)
        if not n or ptr in self.seen or ptr in self.params:
            return t
        # FSDP2 registers the gathered weights as the module's parameters while it runs
        self.params |= self._param_storages()
        if ptr not in self.params:
            self.seen[ptr] = n
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._add, lambda t: t)
        self._hooks.__enter__()
        self._mode = _OpOutputs(self) if self.keep_ops else None
        if self._mode:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode:
            self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


class _OpOutputs(TorchDispatchMode):
    def __init__(self, saved: SavedTensors):
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.saved.keep_ops and torch.is_grad_enabled():
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.saved._add(t)
        return out


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes of distinct storages on this rank."""

    def total(tensors) -> int:
        seen = {}
        for t in tensors:
            ptr, n = _storage(t)
            seen[ptr] = n
        return sum(seen.values())

    params = list(model.parameters())
    out = {
        "params": total(params),
        "grads": total(p.grad for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = total(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
    return out
