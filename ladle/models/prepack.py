"""Linear weights packed once for oneDNN's CPU kernel, for inference (generation's decode steps).

A decode step multiplies a few rows (batch x 1 token) by every weight of the model, so on the CPU
its time is the weights' read. `F.linear` takes the weight in its stored (out, in) layout; oneDNN
can reorder it once into the blocked layout its own kernel reads
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor does for frozen weights), and the same
products then run about twice as fast (bench-30m's batch-8 decode matmuls on a 2-core AMD EPYC,
fp32 and bf16: docs/performance.md). The results agree with `F.linear` to rounding (another
summation order), not bit for bit.

`prepacked(model, batch)` is a context: inside it every plain `nn.Linear` of a CPU model, the
frozen base of each LoRA/DoRA layer (not an NF4 one) and the tied head compute with a packed copy
of their weight; on leaving, the modules are as they were and the copies are freed. A weight
changed in place inside the context (its version counter moves) or replaced is packed again
before its next use, so a product is never computed with stale weights. Nested contexts pack
once. Inference only: the packed op has no backward.
"""

from __future__ import annotations

import contextlib
import platform

import torch
import torch.nn as nn
import torch.nn.functional as F

from ladle.models.llama import TiedHead
from ladle.models.lora import LoRALinear


def packable(w: torch.Tensor) -> bool:
    """A plain CPU matrix in a dtype oneDNN's packed kernel takes on this CPU. Not a DTensor or
    NF4 (those keep their own forward), nor an inference tensor, which has no version counter to
    tell that it changed. x86-64 only: the packed kernels were measured and tested there (Arm
    builds route oneDNN through other libraries)."""
    if type(w) not in (nn.Parameter, torch.Tensor) or w.device.type != "cpu" or w.dim() != 2:
        return False
    if w.is_inference() or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if w.dtype == torch.float32:
        return True
    return w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedWeight:
    """A weight's packed copy, made again whenever the weight object or its version changes."""

    def __init__(self, batch: int):
        self.batch = batch
        self.weight: torch.Tensor | None = None
        self.version = -1
        self.packed: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != w.dtype or torch.is_autocast_enabled("cpu") or torch.is_grad_enabled():
            return F.linear(x, w, b)  # autocast's casts, or a backward: the plain op does those
        if w is not self.weight and not packable(w):  # replaced by a weight we cannot pack
            return F.linear(x, w, b)
        if w is not self.weight or w._version != self.version:
            self.weight, self.version = w, w._version
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, b, "none", [], "")


@contextlib.contextmanager
def prepacked(model: nn.Module, batch: int = 1):
    """Within the block, `model`'s CPU linears compute with packed weights (see the module
    docstring); `batch` is the number of rows a call will usually have (a hint for the layout)."""
    if getattr(model, "_ladle_prepacked", False):  # an outer context packed already
        yield
        return
    patched = []
    embed = getattr(model, "embed_tokens", None)  # None at a pipeline stage without it
    for m in model.modules():
        if type(m) is nn.Linear and packable(m.weight):
            m.forward = _linear_forward(m, PackedWeight(batch))
        elif isinstance(m, LoRALinear) and "weight" in m._parameters and packable(m.weight):
            m.base = _lora_base(m, PackedWeight(batch))  # the adapters are plain linears, packed too
        elif isinstance(m, TiedHead) and embed is not None and packable(embed.weight):
            m.forward = _tied_forward(embed, PackedWeight(batch))
        else:
            continue
        patched.append(m)
    model._ladle_prepacked = True
    try:
        yield
    finally:
        for m in patched:  # the class's methods again; the packed copies go with the closures
            vars(m).pop("forward", None)
            vars(m).pop("base", None)
        model._ladle_prepacked = False


def _linear_forward(m: nn.Linear, pw: PackedWeight):
    return lambda x: pw.linear(x, m.weight, m.bias)


def _lora_base(m: LoRALinear, pw: PackedWeight):
    return lambda x, bias=True: pw.linear(x, m.weight, m.bias if bias else None)


def _tied_forward(embed: nn.Embedding, pw: PackedWeight):
    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return pw.linear(x, weight, None) if weight is embed.weight else F.linear(x, weight)

    return forward
