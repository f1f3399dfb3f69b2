"""Losses: objects a recipe hands to the loop, and the chunked cross-entropy they build on.

A loss returns, for one microbatch, its *sum* over the units it counts (target tokens for a
language model, pairs for DPO, sequences or tokens for RL), that count, and named metrics summed
over the same units. The trainable unit (ladle/train/unit.py) all-reduces the counts of the step's
global batch first and scales every sum by 1 / count, so the gradient does not depend on how the
batch is split into microbatches and ranks, and the same loss runs under gradient accumulation and
under the pipeline schedule. Metrics are summed over microbatches and ranks and turned into the
logged values by `Loss.summarize`: they reach metrics.jsonl, the console and the run card without
the loop knowing their names.

Cross-entropy over large vocabularies without fp32 copies of the logits:

`F.cross_entropy(logits.float(), ...)` on bf16 logits writes three full fp32 tensors of
tokens x vocab (the upcast, the log-softmax, and in backward a zero-filled gradient before the
log-softmax backward) and casts the gradient back down: on bench-30m (8192-way vocabulary) that
was a fifth of the whole training step on CPU, and on a 128k-vocabulary model it is gigabytes of
activation memory. This version works on row chunks: forward keeps one fp32 log-sum-exp per
token, backward rebuilds softmax - one-hot one chunk at a time straight into a gradient of the
logits' own dtype. The math is the same (fp32 accumulation); only rounding order differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ladle.config.schema import MoEConfig

IGNORE_INDEX = -100


def _chunk_rows(vocab: int, device: torch.device) -> int:
    # CPU: an fp32 chunk that stays in the caches (4 MB; 2-8x slower at 16 MB); accelerators: fewer, larger launches.
    budget = 2**20 if device.type == "cpu" else 2**26
    return max(1, budget // vocab)


class _CrossEntropy(torch.autograd.Function):
    """-log softmax(logits)[target] per row (0 where ignored), summed unless `per_token`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, per_token: bool):
        x = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        valid = t != ignore_index
        t = torch.where(valid, t, 0)
        rows = _chunk_rows(x.shape[1], x.device)
        with torch.autocast(x.device.type, enabled=False):
            lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            for s in range(0, x.shape[0], rows):
                torch.logsumexp(x[s : s + rows].float(), dim=-1, out=lse[s : s + rows])
            picked = x.gather(1, t[:, None]).squeeze(1).float()
            loss = (lse - picked) * valid
        ctx.save_for_backward(logits, t, valid, lse)
        ctx.per_token = per_token
        return loss.view(targets.shape) if per_token else loss.sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, t, valid, lse = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(x)
        weight = valid.float() * (grad_out.reshape(-1).float() if ctx.per_token else grad_out.float())
        rows = _chunk_rows(x.shape[1], x.device)
        for s in range(0, x.shape[0], rows):
            e = min(s + rows, x.shape[0])
            p = torch.sub(x[s:e], lse[s:e, None]).exp_()  # softmax, fp32; never in place on the logits
            p[torch.arange(e - s, device=x.device), t[s:e]] -= 1.0
            grad[s:e] = p.mul_(weight[s:e, None])
        return grad.view_as(logits), None, None, None


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sum over the non-ignored targets of -log softmax(logits)[target], in fp32, for logits of
    any float dtype and shape (..., vocab).

    Vocab-sharded logits (a DTensor, from tensor parallelism) take PyTorch's loss-parallel
    cross-entropy, which must run under `loss_parallel()` (ladle/parallel/mesh.py): each rank
    reduces its slice of the vocabulary and the full logits are never gathered."""
    if isinstance(logits, DTensor):
        loss = F.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
        )
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    return _CrossEntropy.apply(logits, targets, ignore_index, False)


def token_logps(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """log softmax(logits)[target] per position, fp32, shape of `targets`; 0 where ignored. The
    chunked kernel of `cross_entropy_sum` (no fp32 copy of the logits), or loss-parallel's
    cross-entropy for vocab-sharded logits (under `loss_parallel()`)."""
    if isinstance(logits, DTensor):
        nll = F.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index, reduction="none"
        )
        nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
        return -nll.view(targets.shape)
    return -_CrossEntropy.apply(logits, targets, ignore_index, True)


@dataclass
class LossOut:
    """One microbatch's loss: `sum` (with its graph) over `count` units, detached metric sums over
    the same units, and `extra`: a term that is a mean already (MoE router losses), added to the
    objective averaged over the step's microbatches and, by the gradient average, over ranks."""

    sum: torch.Tensor
    count: int | torch.Tensor  # a 0-dim tensor spares an accelerator sync
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: torch.Tensor | None = None


class Loss:
    """What a recipe trains on. Subclasses define `count` (known from the batch before the
    forward pass, so the step can be normalised before backward) and `from_output`; `__call__`
    runs the model, `from_output` is what the last pipeline stage calls on its output."""

    console: tuple[str, ...] = ()  # metrics shown on the console line beside the loss
    perplexity = False  # validation also reports exp(loss)
    # A loss that asks the model for some positions only (the RL losses' responses) asks for all
    # under tensor parallelism, whose sequence shards leave a rank a slice of the positions.
    all_positions = False

    def count(self, batch: dict) -> int:
        raise NotImplementedError

    def tokens(self, batch: dict) -> int:
        """The tokens the batch holds, for tokens/s and MFU: every position of packed rows."""
        return batch["tokens"].numel()

    def forward(self, model, batch: dict):
        return model(
            batch["tokens"],
            positions=batch.get("positions"),
            doc_ids=batch.get("doc_ids"),
            attention=batch.get("attention"),  # context parallelism's, with the batch's shard
        )

    def from_output(self, output, batch: dict) -> LossOut:
        raise NotImplementedError

    def __call__(self, model, batch: dict) -> LossOut:
        return self.from_output(self.forward(model, batch), batch)

    def summarize(self, totals: dict[str, float], count: int, parts: int) -> dict:
        """Logged values from metric sums over the global batch (`count` units, `parts`
        microbatch-rank contributions): means per unit by default."""
        return {k: v / max(count, 1) for k, v in totals.items()}


class CausalLMLoss(Loss):
    """Next-token cross-entropy summed over the target tokens (those not IGNORE_INDEX). On an MoE
    model it adds the weighted router losses of the forward pass and reports expert load."""

    perplexity = True

    def __init__(self, moe: MoEConfig | None = None):
        self.moe = moe
        if moe:
            self.console = (*self.console, "moe_imbalance")

    def count(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def from_output(self, logits, batch: dict) -> LossOut:
        targets = batch["targets"]
        return LossOut(cross_entropy_sum(logits, targets, IGNORE_INDEX), (targets != IGNORE_INDEX).sum())

    def __call__(self, model, batch: dict) -> LossOut:
        out = super().__call__(model, batch)
        stats = getattr(getattr(model, "module", model), "router_stats", None)  # unwrapped from DDP
        if self.moe and stats:
            out.extra = router_losses(stats, self.moe)
            if model.training:  # per layer: aux (L,), z (L,), tokens per expert (L, E)
                aux, z, counts = (torch.stack([s[j].detach().float() for s in stats]) for j in range(3))
                out.metrics.update({"moe_aux_loss": aux.mean(), "moe_z_loss": z.mean(), "moe_tokens": counts})
        return out

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        """moe_tokens_min / _max: the fewest and most (token, expert) assignments any expert of any
        layer got in the step; moe_imbalance: the worst layer's max / mean tokens per expert (1.0 =
        even); moe_aux_loss / moe_z_loss: unweighted, averaged over layers, microbatches, ranks."""
        if "moe_tokens" not in totals:
            return {}
        counts = totals["moe_tokens"]
        return {
            "moe_aux_loss": float(totals["moe_aux_loss"]) / parts,
            "moe_z_loss": float(totals["moe_z_loss"]) / parts,
            "moe_tokens_min": int(counts.min()),
            "moe_tokens_max": int(counts.max()),
            "moe_imbalance": float((counts.max(1).values / counts.mean(1)).max()),
        }


class MixLoss(CausalLMLoss):
    """The causal-LM loss of a data mixture (ladle/data/mix.py), also per source: a batch's
    `source` (B,) names each row's, and `loss/<name>` is that source's mean over its target
    tokens in the step (`val_loss/<name>` in validation)."""

    def __init__(self, names: list[str], moe: MoEConfig | None = None):
        super().__init__(moe)
        self.names = names

    def from_output(self, logits, batch: dict) -> LossOut:
        targets = batch["targets"]
        valid = targets != IGNORE_INDEX
        nll = -token_logps(logits, targets, IGNORE_INDEX)  # (B, T), 0 where ignored
        src, k = batch["source"], len(self.names)
        zeros = torch.zeros(k, dtype=torch.float32, device=nll.device)
        sums = zeros.index_add(0, src, nll.detach().sum(-1))
        counts = zeros.index_add(0, src, valid.sum(-1).float())
        return LossOut(nll.sum(), valid.sum(), {"mix_loss": sums, "mix_tokens": counts})

    def summarize(self, totals: dict, count: int, parts: int) -> dict:
        out = super().summarize(totals, count, parts)
        sums, counts = totals.get("mix_loss"), totals.get("mix_tokens")
        if sums is not None:
            for name, s, n in zip(self.names, sums.tolist(), counts.tolist(), strict=True):
                if n:
                    out[f"loss/{name}"] = s / n
        return out


def router_losses(stats: list[tuple[torch.Tensor, ...]], cfg: MoEConfig) -> torch.Tensor:
    """The weighted router losses of one forward pass, averaged over the MoE layers."""
    aux = torch.stack([s[0] for s in stats]).mean()
    z = torch.stack([s[1] for s in stats]).mean()
    return cfg.aux_loss_weight * aux + cfg.z_loss_weight * z
