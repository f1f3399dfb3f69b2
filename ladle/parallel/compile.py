"""torch.compile per transformer block, as torchtitan does.

Compiling block by block (not the whole model) keeps compile time flat in depth: every block has
the same code, so one compiled graph serves all of them. `nn.Module.compile` compiles in place,
so parameter names, checkpoints and HF export are unchanged. Attention itself runs eagerly (see
`Attention.attend`): its varying packed-document split and the KV cache would otherwise cause a
recompile per batch composition, and SDPA is a single kernel either way.
"""

from __future__ import annotations

import contextlib

import torch


def compile_blocks(model: torch.nn.Module) -> None:
    for _, block in model.blocks():
        block.compile()


def eager():
    """A context where compiled modules run their plain Python code (one-off generation at the end
    of a run, whose ever-changing shapes would only trigger recompiles)."""
    return (
        torch.compiler.set_stance("force_eager")
        if hasattr(torch.compiler, "set_stance")
        else contextlib.nullcontext()
    )
