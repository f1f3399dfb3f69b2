"""Context parallelism: every sample's tokens split over the `cp` ranks of a group, for sequences
whose activations do not fit on one device.

The split is load-balanced the way PyTorch's context-parallel API does it (its
`_HeadTailLoadBalancer`): the sequence is cut into 2 x cp chunks and rank r keeps chunks r and
2cp - 1 - r, so that under the causal mask every rank has the same amount of attention work.
Everything but attention is per token and runs on the local tokens unchanged; attention needs
every earlier key, which two implementations provide (`parallel.cp_attention`):

- `allgather` (default; any device, gloo included): each layer all-gathers the keys and values
  of the group (autograd's backward reduce-scatters their gradients) and attends its local
  queries to all of them under a mask computed from the tokens' global slots and document ids.
  This is the design of Llama 3's context parallelism and of PyTorch's flex-attention CP: the
  keys and values of a whole sample (small under GQA) are held once per layer, the queries and
  everything else stay split. Documents stay masked from each other.
- `ring`: PyTorch's ring attention (`torch.distributed.tensor.experimental`), which passes key
  and value blocks around the ring and merges partial softmaxes, holding never more than two
  blocks. It has CUDA kernels only and knows only the plain causal mask, so it needs
  `data.document_mask: false`.

The training loop calls `shard(batch)` on each microbatch (`Parallel.shard_sequence`); the local
batch carries the attention object under "attention", which the model uses in place of its own.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ladle.errors import ConfigError

ATTENTIONS = ("allgather", "ring")


def shard_indices(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global token slots rank `rank` holds: chunks `rank` and `2cp - 1 - rank` of 2cp."""
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail])


class ContextParallel:
    """One rank's view of its context-parallel group (mesh: the 1-D `cp` submesh)."""

    def __init__(self, mesh, attention: str = "allgather"):
        if attention not in ATTENTIONS:
            raise ValueError(f"cp attention {attention!r}: expected one of {ATTENTIONS}")
        self.mesh, self.attention = mesh, attention
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        if attention == "ring":
            if mesh.device_type != "cuda":
                raise ConfigError(
                    f"parallel.cp_attention=ring: PyTorch's ring attention has CUDA kernels only, not "
                    f"{mesh.device_type}; use parallel.cp_attention=allgather"
                )
            from torch.distributed.tensor.experimental._attention import (
                _cp_options,
                _enable_context_parallel_dispatcher,
            )

            # Route SDPA on Shard(2) DTensors to ring attention over head-tail-balanced shards.
            _cp_options.enable_load_balance = True
            _enable_context_parallel_dispatcher()

    def shard(self, batch: dict) -> dict:
        """This rank's part of a (B, T) batch, with the attention that joins the parts."""
        tokens = batch["tokens"]
        B, T = tokens.shape
        idx = shard_indices(T, self.size, self.rank, tokens.device)
        positions = batch.get("positions")
        if positions is None:  # RoPE needs each token's global position
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        local = {  # per-row values (a mixture's `source`) stay whole
            k: v[:, idx] if v.ndim > 1 else v
            for k, v in batch.items()
            if k not in ("positions", "doc_ids", "attention")
        }
        local["positions"] = positions[:, idx]
        doc_ids = batch.get("doc_ids")
        if self.attention == "ring":
            if doc_ids is not None and bool((doc_ids != doc_ids[:, :1]).any()):
                raise ValueError("ring attention has no document mask; set data.document_mask=false")
            local["attention"] = RingAttention(self.mesh)
        else:
            local["attention"] = GatheredAttention(self, idx, T, doc_ids)
        return local


class GatheredAttention:
    """Local queries against the whole group's keys and values (see the module docstring)."""

    def __init__(self, cp: ContextParallel, idx: torch.Tensor, seq_len: int, doc_ids: torch.Tensor | None):
        self.cp = cp
        # Gathered keys arrive rank by rank, so the slot of key j is all_slots[j]: the mask is
        # built in that order and the keys are never permuted back.
        all_slots = torch.cat([shard_indices(seq_len, cp.size, r, idx.device) for r in range(cp.size)])
        self.idx, self.all_slots = idx, all_slots
        mask = all_slots[None, :] <= idx[:, None]  # (T/cp, T) causal over global slots
        if doc_ids is not None:
            same = doc_ids[:, idx, None] == doc_ids[:, None, all_slots]  # (B, T/cp, T)
            mask = mask[None] & same
        else:
            mask = mask[None]
        self.mask = mask[:, None]  # (B or 1, 1, T/cp, T); a query always sees itself

    def windowed(self, window: int) -> GatheredAttention:
        """The same, each query seeing only the `window` positions up to its own (sliding window)."""
        out = copy.copy(self)
        out.mask = self.mask & (self.all_slots[None, :] > self.idx[:, None] - window)
        return out

    def attend(self, q, k, v) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

        k = wait_tensor(all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.cp.group))
        v = wait_tensor(all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.cp.group))
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, enable_gqa=k.shape[1] != q.shape[1]
        )


class RingAttention:
    """PyTorch's ring attention on this rank's shard (causal; CUDA kernels only)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def attend(self, q, k, v) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        if k.shape[1] != q.shape[1]:  # the ring kernels take as many kv heads as query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        q, k, v = (DTensor.from_local(t, self.mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()
