"""Pipeline parallel with `torch.distributed.pipelining`: the model cut into stages by layers.

The stages are copies of the (meta-device) model that keep only their blocks, in an
nn.ModuleDict under their indices in the whole model (so parameter names stay the model's), the
first with the embedding, the last with the final norm and head; `Llama.forward` runs whatever a
part holds. Stages hand `(hidden, positions, doc_ids, microbatch index)` on, so every stage masks
documents and applies RoPE like the whole model would. On an MoE model every stage adds its
layers' router losses to its own backward and keeps their statistics (`_Router`).

Each optimizer step's microbatches (`train.grad_accum_steps`) are the pipeline's microbatches.
Schedules: `gpipe`, `1f1b` (one stage per rank), `interleaved_1f1b`, `interleaved_zb`
(interleaved zero bubble) and `zbv` (zero bubble, V-shaped: rank r holds stages r and 2pp-1-r),
two stages per rank. The last stage computes the recipe's loss object (ladle/train/loss.py) on
its output and the microbatch, scaled by the step's 1 / (units of the global batch) factor as in
gradient accumulation, with the schedule's own gradient scaling off. The schedule splits tensors
only, so it is handed each row's microbatch index as its `target` and the loss looks the
microbatch up.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ladle.models.moe import MoE

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2}


def stage_bounds(n_layers: int, n_stages: int, split: list[int] | None) -> list[tuple[int, int]]:
    """[start, end) layers of each stage: `split` (where stages 1.. begin) or as even as can be."""
    if split:
        starts = [0, *split]
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
        starts = [sum(sizes[:s]) for s in range(n_stages)]
    return list(zip(starts, [*starts[1:], n_layers], strict=True))


def stage_ids(rank: int, pp: int, schedule: str) -> list[int]:
    if STAGES_PER_RANK[schedule] == 1:
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp]  # looped: interleaved schedules


def split_model(model: nn.Module, bounds: list[tuple[int, int]], stages: list[int]) -> list[nn.Module]:
    """This rank's parts of a meta-device model (one per stage it holds)."""
    parts = []
    last = len(bounds) - 1
    for s in stages:
        part = copy.deepcopy(model)
        a, b = bounds[s]
        part.layers = nn.ModuleDict({str(i): part.layers[i] for i in range(a, b)})
        if s != 0:
            part.embed_tokens = None
        if s != last:
            part.norm = None
            part.lm_head = None
        parts.append(part)
    return parts


class RankModel(nn.Module):
    """All parts of this rank under the model's own names (embed_tokens, layers.N, norm,
    lm_head): what the optimizer, clipping and checkpoints see. Not called itself."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = parts  # a plain list: not registered twice
        layers = {}
        for p in parts:
            layers.update(p.layers.items())
        self.layers = nn.ModuleDict(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))
        for name in ("embed_tokens", "norm", "lm_head"):
            mod = next((getattr(p, name) for p in parts if getattr(p, name, None) is not None), None)
            if mod is not None:
                setattr(self, name, mod)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through its schedule (Pipeline.step)")


class _Stage(nn.Module):
    """Passes positions, doc_ids and each row's microbatch index on to the next stage beside the
    hidden states; on an MoE model, gives its router losses their gradient (`_Router`)."""

    def __init__(self, part: nn.Module, last: bool, router: _Router | None = None):
        super().__init__()
        self.part, self.last, self.router = part, last, router
        self.ordinals = [m.ordinal for m in part.modules() if isinstance(m, MoE)]

    def forward(self, x, positions, doc_ids, micro):
        out = self.part(x, positions=positions, doc_ids=doc_ids)
        stats = getattr(self.part, "router_stats", None)
        if self.router is not None and stats:
            out = self.router.record(out, stats, self.ordinals, int(micro[0]))
        return out if self.last else (out, positions, doc_ids, micro)


class _AddLoss(torch.autograd.Function):
    """`x` unchanged; in backward, `loss` gets gradient 1 beside x's (DeepSeek's AddAuxiliaryLoss):
    a stage's router losses get their gradient when the schedule runs that stage's backward."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.like = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return grad, torch.ones(shape, dtype=dtype, device=device)


class _Router:
    """The router losses of an MoE model cut into stages. Without a pipeline the loss object adds
    them to the last output (ladle/train/loss.py); here each stage adds its layers' share of the
    same objective to its own backward: (aux_loss_weight x aux + z_loss_weight x z), summed over
    its layers, over (MoE layers x microbatches). It also keeps each microbatch's statistics of
    this rank's layers for the step's metrics and the bias update, by microbatch: the schedule's
    shape inference runs the stages once more on its first step, and the real calls replace it."""

    def __init__(self, moe, n_layers: int, n_micro: int):
        self.moe, self.n_layers, self.n_micro = moe, n_layers, n_micro
        self.seen: dict = {}

    def record(self, out, stats, ordinals: list[int], micro: int):
        if torch.is_grad_enabled():  # training (validation runs the stages under no_grad)
            aux = torch.stack([s[0] for s in stats]).sum()
            z = torch.stack([s[1] for s in stats]).sum()
            share = (self.moe.aux_loss_weight * aux + self.moe.z_loss_weight * z) / (
                self.n_layers * self.n_micro
            )
            out = _AddLoss.apply(out, share)
        if 0 <= micro < self.n_micro:
            self.seen[(ordinals[0], micro)] = (
                ordinals,
                [tuple(t.detach().float() for t in s) for s in stats],
            )
        return out

    def metrics(self) -> dict[str, torch.Tensor]:
        """This rank's share of the step's MoE metrics, in the loss object's units (summed over
        the pipeline's ranks, they are what one process reports)."""
        E = self.moe.n_experts
        aux, z, counts = torch.zeros(()), torch.zeros(()), torch.zeros(self.n_layers, E)
        for ordinals, stats in self.seen.values():
            for i, (a, b, c) in zip(ordinals, stats, strict=True):
                aux, z = aux + a.cpu() / self.n_layers, z + b.cpu() / self.n_layers
                counts[i] += c.cpu()
        self.seen = {}
        return {"moe_aux_loss": aux, "moe_z_loss": z, "moe_tokens": counts}


class Pipeline:
    def __init__(
        self, parts, stages: list[int], n_stages: int, schedule: str, n_micro: int, pp_group, device, hidden
    ):
        from torch.distributed.pipelining import PipelineStage

        self.n_stages = n_stages
        self.first, self.last = 0 in stages, n_stages - 1 in stages
        moe = parts[0].cfg.moe
        self.router = _Router(moe, parts[0].cfg.n_layers - moe.dense_layers, n_micro) if moe else None
        self.modules = {
            s: _Stage(p, s == n_stages - 1, self.router) for p, s in zip(parts, stages, strict=True)
        }
        wrapped = [PipelineStage(m, s, n_stages, device, group=pp_group) for s, m in self.modules.items()]
        self.schedule = _schedule(schedule, wrapped, n_micro, self._loss)
        # Validation runs the stages in order by hand (forward only, any placement: torch's
        # zero-bubble V schedule has no forward-only mode).
        pp = torch.distributed.get_world_size(pp_group)
        self.owner = {s: r for r in range(pp) for s in stage_ids(r, pp, schedule)}
        self.group, self.rank = pp_group, torch.distributed.get_rank(pp_group)
        self.hidden = hidden  # (tokens, dim) of the activations passed between stages
        self._step = None  # (loss, microbatches, scale, outputs) of the step being run

    def _loss(self, output, index):
        loss, micro, scale, outs = self._step
        i = int(index[0])
        out = loss.from_output(output, micro[i])
        # By microbatch: on its first step the schedule also runs the loss on the outputs of its
        # shape inference (uninitialised values); the real call of microbatch 0 replaces it.
        outs[i] = out
        return out.sum * scale if out.extra is None else out.sum * scale + out.extra / len(micro)

    def run(self, micro: list[dict], loss, scale: float) -> list:
        """Forward and backward of the step's microbatches through the schedule; the LossOut of
        each microbatch on the rank holding the last stage, [] elsewhere."""
        cat = {k: torch.cat([b[k] for b in micro]) for k in ("tokens", "positions", "doc_ids")}
        self._step = (loss, micro, scale, {})
        rows = micro[0]["tokens"].shape[0]
        index = torch.arange(len(micro)).repeat_interleave(rows)  # row -> its microbatch
        dev = cat["tokens"].device
        args = (cat["tokens"], cat["positions"], cat["doc_ids"], index.to(dev)) if self.first else ()
        kwargs = {"target": index, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        outs, self._step = self._step[3], None
        return [outs[i] for i in sorted(outs)]

    def router_metrics(self) -> dict[str, torch.Tensor]:
        """This rank's share of the last step's MoE metrics ({} on a dense model)."""
        return self.router.metrics() if self.router is not None else {}

    @torch.no_grad()
    def forward_only(self, b: dict, loss):
        """The LossOut of one batch run through the stages in order on the last stage's rank, None
        elsewhere."""
        out, dev = None, b["tokens"].device
        for s in range(self.n_stages):
            if self.owner[s] != self.rank:
                continue
            if s == 0:
                micro = torch.full((b["tokens"].shape[0],), -1, device=dev)  # no step's microbatch
                inp = (b["tokens"], b["positions"], b["doc_ids"], micro)
            elif self.owner[s - 1] == self.rank:
                inp = out
            else:
                B = b["tokens"].shape[0]
                x = torch.empty(B, *self.hidden, device=dev)
                pos, doc = torch.empty_like(b["positions"]), torch.empty_like(b["doc_ids"])
                micro = torch.empty(B, dtype=torch.long, device=dev)
                for t in (x, pos, doc, micro):
                    torch.distributed.recv(t, group=self.group, group_src=self.owner[s - 1])
                inp = (x, pos, doc, micro)
            out = self.modules[s](*inp)
            if s < self.n_stages - 1 and self.owner[s + 1] != self.rank:
                x, pos, doc, micro = out
                for t in (x.float().contiguous(), pos, doc, micro):
                    torch.distributed.send(t, group=self.group, group_dst=self.owner[s + 1])
        if self.owner[self.n_stages - 1] == self.rank:
            return loss.from_output(out, b)
        return None


def _schedule(kind: str, stages, n_micro: int, loss_fn):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    if kind in ("gpipe", "1f1b"):
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        return cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)
    cls = {
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "interleaved_zb": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
    }[kind]
    return cls(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
