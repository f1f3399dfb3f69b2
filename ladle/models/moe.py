"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a top-k softmax router and dropless SwiGLU experts.

Every token goes to its `top_k` experts, none is dropped: tokens are sorted by expert so that each
expert's rows are contiguous, then all experts run as one grouped matmul (`F.grouped_mm`) where
PyTorch has a kernel for it, or as a loop over experts otherwise; both give the same numbers.

Expert weights are stored stacked, in nn.Linear's (out, in) layout per expert:
`experts.gate_proj` and `experts.up_proj` (E, ffn, dim), `experts.down_proj` (E, dim, ffn). One
parameter per kind keeps every expert's gradient defined even when it got no tokens (data-parallel
wrappers need that), and lets a loader fill expert e's slice from Hugging Face's per-expert tensors.

`MoE.forward` returns the output and the router's statistics for the step: the load-balancing
loss, the z-loss and the tokens each expert received; the model collects them per layer and the
causal-LM loss adds the weighted losses and reports expert load (ladle/train/loss.py). Model code
runs no collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from ladle.config.schema import ModelConfig, MoEConfig
from ladle.models.layers import MLP

# Rows per expert are padded to this multiple for CUDA's grouped GEMM: its weight gradient
# contracts over each group's rows, which need 16-byte alignment (8 bf16 rows; 16 covers fp8).
CUDA_GROUP_ALIGN = 16


class Experts(nn.Module):
    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x (rows, dim) sorted by expert, `counts` (E,) rows per expert -> (rows, dim)."""
        # Weights are cast like autocast would cast a Linear's (grouped_mm is not on its op list).
        # Under expert parallelism they are DTensors and x holds the rows of this rank's experts.
        wg, wu, wd = (_local(w).to(x.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(grouped_mm(x, wg.transpose(-2, -1), offs)) * grouped_mm(x, wu.transpose(-2, -1), offs)
            return grouped_mm(h, wd.transpose(-2, -1), offs)
        out = []
        for e, xe in enumerate(x.split(counts.tolist())):
            out.append(F.linear(F.silu(F.linear(xe, wg[e])) * F.linear(xe, wu[e]), wd[e]))
        return torch.cat(out)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight as this rank uses it. Expert parallel: its shard of the experts. Tensor parallel
    (the weight replicated): each rank routes its own shard of the sequence, so its gradient is
    this rank's part of a sum over the group (`Partial`), which DTensor completes."""
    if not isinstance(w, DTensor):
        return w
    return w.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in w.placements])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10
    return fn(a, b, offs=offs)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ordinal: int = 0):
        super().__init__()
        m: MoEConfig = cfg.moe
        self.ordinal = ordinal  # its place among the model's MoE layers (its row of the step's counts)
        self.n_experts, self.top_k, self.norm_topk_prob = m.n_experts, m.top_k, m.norm_topk_prob
        self.dispatch = m.dispatch
        self.gate = nn.Linear(cfg.dim, m.n_experts, bias=False)  # the router
        self.experts = Experts(m.n_experts, cfg.dim, m.ffn_dim)
        self.sigmoid = m.scoring == "sigmoid"
        self.bias_rate = m.bias_update_rate
        self.per_sequence = m.aux_loss_scope == "sequence"
        self.n_group, self.topk_group, self.scale = m.n_group, m.topk_group, m.routed_scaling_factor
        if self.sigmoid:  # DeepSeek-V3: added to the scores for the choice only (aux-loss-free balancing)
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(m.n_experts))
        if m.n_shared_experts:
            shared = cfg.model_copy(update={"ffn_dim": m.ffn_dim * m.n_shared_experts})
            self.shared_experts = MLP(shared)

    # Eager under train.compile, like attention: the routing is data-dependent (counts per expert),
    # which would break the graph and recompile as the counts change.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """x (B, T, dim) -> (y (B, T, dim), (aux_loss, z_loss, tokens_per_expert (E,))).

        `replay` (B, T, k): experts to route each token to instead of the router's own choice
        (routing replay: the choice the sampler made), -1 where the router chooses; the weights
        are the router's probabilities (scores) of the experts used, so it still learns. The
        router's own choice is left in `self.choice` (N, k), replayed or not, and the experts the
        tokens went to in `self.used`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        N, E, k = x.shape[0], self.n_experts, self.top_k
        if self.sigmoid:
            logits, probs, weights, chosen = self._route_sigmoid(x, replay)
        else:
            logits = F.linear(x, _local(self.gate.weight))  # (N, E)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, k, dim=-1)  # (N, k) each
            chosen = self._replayed(chosen, replay)
            if replay is not None:
                weights = probs.gather(1, chosen)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)

        # Dropless dispatch: the N*k (token, expert) pairs sorted by expert.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)  # (E,)
        token = order // k  # the token of each sorted pair
        grouped = self._grouped(x)
        align = group_align(x.device, grouped)
        rows, padded = pad_groups(token, counts, align, pad_index=N)
        xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[rows] if align > 1 else x[rows]
        ys = self.experts(xs, padded, grouped)
        if align > 1:
            ys = ys[rows != N]  # drop the padding rows again (they follow `order`)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        y = torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))

        # Load-balancing loss as transformers' load_balancing_loss_func for one layer: E times the
        # dot product of each expert's share of the top-k picks (summing to k) and its mean router
        # probability; k when perfectly balanced. z-loss (ST-MoE): mean squared log-partition.
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        if self.sigmoid:  # DeepSeek's balance loss reads the scores normalised per token
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if self.per_sequence and len(shape) == 3:  # each sequence's balance, then their mean
            B, T = shape[0], shape[1]
            picks = torch.zeros(B, T * k, E, device=x.device).scatter_(2, chosen.view(B, T * k, 1), 1.0)
            share_b = picks.sum(1) / T  # (B, E), summing to k
            aux = E * (share_b * probs.view(B, T, E).mean(1)).sum(1).mean()
        else:
            share = counts.to(torch.float32) / N
            aux = E * torch.dot(share, probs.mean(dim=0))
        z = torch.logsumexp(logits.float(), dim=-1).square().mean()
        return y.reshape(shape), (aux, z, counts.detach())

    def _replayed(self, chosen: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
        """The router's choice kept as `self.choice`; the experts used: `replay`'s where given."""
        self.choice = self.used = chosen.detach()
        if replay is None:
            return chosen
        r = replay.reshape(-1, self.top_k).to(device=chosen.device, dtype=chosen.dtype)
        used = torch.where(r[:, :1] >= 0, r, chosen)
        self.used = used.detach()  # the experts the tokens went to
        return used

    def _route_sigmoid(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """DeepSeek-V3's router, as transformers' `DeepseekV3TopkRouter`: fp32 sigmoid scores;
        experts chosen on score + correction bias, within the `topk_group` best of `n_group`
        groups (a group ranked by the sum of its two best); weights are the plain scores of the
        chosen, renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`)."""
        N, E, k = x.shape[0], self.n_experts, self.top_k
        with torch.autocast(x.device.type, enabled=False):  # fp32 scores under bf16-mixed too
            logits = F.linear(x.float(), _local(self.gate.weight).float())  # (N, E)
        scores = logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.n_group > 1:
            groups = choice.view(N, self.n_group, E // self.n_group)
            best = groups.topk(2, dim=-1)[0].sum(dim=-1)  # (N, n_group)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1)[1], 1.0)
            choice = choice.masked_fill(
                ~keep.bool().repeat_interleave(E // self.n_group, dim=1), float("-inf")
            )
        chosen = self._replayed(choice.topk(k, dim=-1)[1], replay)
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, scores, weights * self.scale, chosen

    def _grouped(self, x: torch.Tensor) -> bool:
        if self.dispatch != "auto":
            return self.dispatch == "grouped_mm"
        return grouped_mm_supported(x.device, x.dtype, self.experts.gate_proj.shape[1:])


def choices(model: nn.Module) -> torch.Tensor | None:
    """The router's own choices of the model's last forward: (N, MoE layers, k), layers in their
    order (None for a dense model, or before a forward)."""
    layers = sorted((m for m in model.modules() if isinstance(m, MoE)), key=lambda m: m.ordinal)
    if not layers or any(getattr(m, "choice", None) is None for m in layers):
        return None
    return torch.stack([m.choice for m in layers], 1)


@torch.no_grad()
def update_correction_bias(model: nn.Module, counts: torch.Tensor) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): each sigmoid-routed MoE layer's correction bias
    moves by its `bias_rate` towards balance, up for an expert that got fewer tokens than the
    layer's mean, down for one that got more. `counts` (MoE layers of the whole model, E): the
    tokens each expert got in the step's global batch, the same on every rank, so every rank moves
    its copy alike; a pipeline stage holds some layers and reads their rows (`MoE.ordinal`)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if moe.sigmoid and moe.bias_rate:
            c = counts[moe.ordinal].to(torch.float32)
            bias = moe.gate.e_score_correction_bias
            bias += (moe.bias_rate * torch.sign(c.mean() - c)).to(bias.device, bias.dtype)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Where `auto` dispatch uses the grouped matmul: on CPU (torch >= 2.9) when the rows are
    16-byte aligned, and on CUDA for bf16 on compute capability 9.0+ (Hopper), where the kernel is
    meant for. Elsewhere the loop over experts (same numbers)."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    if any((n * dtype.itemsize) % 16 for n in shape):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def group_align(device: torch.device, grouped: bool) -> int:
    return CUDA_GROUP_ALIGN if grouped and device.type == "cuda" else 1


def pad_groups(
    token: torch.Tensor, counts: torch.Tensor, align: int, pad_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices with each expert's group padded to a multiple of `align` (padding rows read
    `pad_index`, a zero row), and the padded counts. align=1 returns the inputs unchanged."""
    if align == 1:
        return token, counts
    padded = (counts + align - 1) // align * align
    starts = padded.cumsum(0) - padded  # where each padded group begins
    # Position of each sorted pair inside its group, then in the padded layout.
    group = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    within = torch.arange(len(token), device=token.device) - (counts.cumsum(0) - counts)[group]
    rows = torch.full((int(padded.sum()),), pad_index, dtype=token.dtype, device=token.device)
    rows[starts[group] + within] = token
    return rows, padded


def init_moe(moe: MoE, std: float, out_std: float) -> None:
    nn.init.normal_(moe.gate.weight, 0.0, std)
    if moe.sigmoid:
        moe.gate.e_score_correction_bias.zero_()
    nn.init.normal_(moe.experts.gate_proj, 0.0, std)
    nn.init.normal_(moe.experts.up_proj, 0.0, std)
    nn.init.normal_(moe.experts.down_proj, 0.0, out_std)
