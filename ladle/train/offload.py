"""Idle models in host memory: the RL recipes' shared placement keeps every model on every rank,
and on an accelerator moves those a phase does not use (the reference, the reward model, the
critic and its optimizer state while the policy generates) to host memory and back.

`module.to(device)` is the move for a plain model and for an FSDP2 one alike (FSDP2 re-registers
its sharded parameters after `_apply`, so each rank moves only its shards); an optimizer's state
tensors move one by one. On a CPU run the device is the host: nothing moves.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def _park_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> list:
    """The state tensors on `device` to the host; returns where they were, for `_unpark_optimizer`
    (a non-fused AdamW's CPU step counters stay where they are)."""
    moved = []
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device == device:
                state[k] = v.to(HOST)
                moved.append((state, k))
    return moved


def _unpark_optimizer(moved: list, device: torch.device) -> None:
    for state, k in moved:
        state[k] = state[k].to(device)


class Parking:
    """Named models (and optimizers) moved between `device` and the host. `where[name]` says
    where each is ("device" or "host"), for logs and tests."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled and device.type != "cpu"
        self.items: dict[str, tuple] = {}
        self.where: dict[str, str] = {}
        self._moved: dict[str, list] = {}

    def add(self, name: str, model, optimizer=None) -> None:
        """`model` (and its optimizer) under `name`; None, or a model on other ranks (a separated
        placement's `Remote`), is not parked."""
        if isinstance(model, torch.nn.Module):
            self.items[name] = (model, optimizer)
            self.where[name] = "device"

    def park(self, *names: str) -> None:
        """To host memory (a name not added is skipped)."""
        self._move([n for n in names if n in self.items], "host")

    def unpark(self, *names: str) -> None:
        """Back to the device, before use."""
        self._move([n for n in names if n in self.items], "device")

    def _move(self, names: list[str], to: str) -> None:
        for name in names:
            if self.where[name] == to:
                continue
            if self.enabled:
                model, optimizer = self.items[name]
                model.to(HOST if to == "host" else self.device)
                if optimizer is not None and to == "host":
                    self._moved[name] = _park_optimizer(optimizer, self.device)
                elif optimizer is not None:
                    _unpark_optimizer(self._moved.pop(name, []), self.device)
            self.where[name] = to
        if self.enabled and to == "host" and names and self.device.type == "cuda":
            torch.cuda.empty_cache()
