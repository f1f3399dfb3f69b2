"""torch.compile per transformer block, as torchtitan does.

Compiling block by block (not the whole model) keeps compile time flat in depth: every block has
the same code, so one compiled graph serves all of them. `nn.Module.compile` compiles in place,
so parameter names, checkpoints and HF export are unchanged.

Attention itself (`Attention.attend`) runs eagerly: its varying packed-document split would
otherwise cause a recompile per batch composition, and SDPA is a single kernel either way. Not
under tensor parallelism: a graph break inside a block makes dynamo cut the block's graph at the
attention call, so DTensors (the norm's output, the gathered sequence) cross graph boundaries, and
on torch 2.13 with inductor the compiled backward then assumes the wrong placement for their
gradients (a Partial gradient taken as Replicate: a missing reduce-scatter, wrong norm and
embedding gradients). The whole block is one graph there.
"""

from __future__ import annotations

import contextlib

import torch


def compile_blocks(model: torch.nn.Module, eager_attention: bool = True) -> None:
    for _, block in model.blocks():
        if eager_attention:
            attn = block.self_attn
            attn.attend = torch.compiler.disable(attn.attend)
        block.compile()


def eager():
    """A context where compiled modules run their plain Python code (one-off generation at the end
    of a run, whose ever-changing shapes would only trigger recompiles)."""
    return (
        torch.compiler.set_stance("force_eager")
        if hasattr(torch.compiler, "set_stance")
        else contextlib.nullcontext()
    )
