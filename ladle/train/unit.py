"""A trainable unit: one model and what updates it (optimizer, schedule, precision, clipping), and
the forward and backward of a step's microbatches under any layout.

A recipe holds one unit per trained model (the policy; PPO's value model) beside frozen models it
only runs forward (a DPO reference). The loop (ladle/train/loop.py) owns the cadence: when to
step, log, validate and save; a unit owns what one step does to its model:

    result = unit.forward_backward(microbatches, loss)  # gradients of sum / global count
    update = unit.step(result.loss)                      # clip, optimizer, schedule

`forward_backward` is the one place where a loss meets the model: gradient accumulation (with
the data-parallel wrapper's gradient sync on the last microbatch only) or the pipeline schedule,
so every recipe's loss object runs under pipeline parallelism too.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ladle import device as dev
from ladle import watchdog
from ladle.checkpoint.dcp import TRAINABLE
from ladle.config import LadleConfig
from ladle.models.moe import update_correction_bias
from ladle.parallel.clip import clip_grad_norm_, total_norm
from ladle.parallel.mesh import Parallel
from ladle.train.guard import Verdict
from ladle.train.loss import Loss, LossOut
from ladle.train.optim import build_optimizer, build_scheduler
from ladle.train.precision import Precision


@dataclass
class Result:
    """A step's forward and backward, over the global batch: `loss` = the loss sums / `count`."""

    loss: float
    count: int
    tokens: int  # tokens of the global batch (padding included)
    metrics: dict = field(default_factory=dict)  # the loss's summarized metrics
    t_bwd: float = 0.0  # perf_counter when backward ended (for the step-time breakdown)
    local: tuple[float, int] | None = None  # this rank's loss sum and count (None: a stage without it)


@dataclass
class Update:
    """What `TrainUnit.step` did with a step's gradients."""

    lr: float  # the lr the step used
    grad_norm: float
    finite: bool  # the loss and the gradient norm were finite (or fp16's scaler owns the inf)
    skipped: bool  # no update reached the weights (non-finite, the guard's skip, fp16's back-off)
    verdict: Verdict | None = None  # the guard's, when it judged
    update_ratio: float | None = None  # ||new - old|| / ||old||, on a measured step


class TrainUnit:
    def __init__(
        self,
        cfg: LadleConfig,
        model: torch.nn.Module,
        device: torch.device,
        parallel: Parallel,
        pipeline=None,
    ):
        self.model, self.device, self.parallel, self.pipeline = model, device, parallel, pipeline
        self.precision = Precision(cfg.precision, device)
        self.optimizer = build_optimizer(model, cfg.optim, device, cfg.precision.mode)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler, cfg.train.max_steps)
        self.grad_clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        self._shapes: dict = {}  # metric shapes under PP (known to the last stage), train and eval

    @contextlib.contextmanager
    def numerics(self):
        """The training forward's numerics for forward-only passes that must match the loss's
        (the RL recipes' sampling, old and reference log-probs): autocast, and loss-parallel
        scoring of vocabulary shards under TP."""
        with self.precision.autocast(), self.parallel.loss_context():
            yield

    # -- one step --------------------------------------------------------------------------
    def forward_backward(self, micro: list[dict[str, torch.Tensor]], loss: Loss, inject=None) -> Result:
        # Every sum is divided by the count of the whole global batch, so the gradient does not
        # depend on how the batch is split into microbatches and ranks. Data-parallel wrappers
        # (DDP, FSDP) average gradients over the ranks whose units differ (the data ranks, times
        # cp: context parallelism splits each sample's tokens), hence that factor; the ranks of a
        # TP or PP group share their units.
        # `inject`: a fault drill's (ladle/faults.py): a stop before the first collective,
        # and the loss sums (so the gradients) scaled, a NaN or a spike
        par = self.parallel
        micro = [par.shard_sequence(b) for b in micro]
        local = sum(loss.count(b) for b in micro)
        if inject is not None:
            inject.stop()
        with watchdog.within("collective: all_reduce (the loss count of the batch)"):
            total = int(par.all_reduce_loss(torch.tensor([local], device=self.device)).item())
        scale = par.loss_size / max(total, 1)
        self.model.train()
        if self.pipeline is not None:  # the schedule runs every microbatch's forward and backward
            watchdog.phase("forward and backward (pipeline schedule)")
            with par.loss_context(), self.precision.autocast():
                outs = self.pipeline.run(micro, loss, scale)
            router = self.pipeline.router_metrics()  # an MoE model's: each stage has its layers'
        else:
            outs, router = [], {}
            for i, b in enumerate(micro):
                # A data-parallel wrapper all-reduces gradients on the last microbatch only.
                sync = i == len(micro) - 1 or not hasattr(self.model, "no_sync")
                with contextlib.nullcontext() if sync else self.model.no_sync(), par.loss_context():
                    watchdog.phase("forward")
                    with self.precision.autocast():
                        out = loss(self.model, b)
                        if inject is not None and inject.factor != 1.0:
                            out.sum = out.sum * inject.factor
                        objective = out.sum * scale
                        if out.extra is not None:
                            objective = objective + out.extra / len(micro)
                    watchdog.phase("backward")
                    self.precision.scale(objective).backward()
                out.sum = out.sum.detach()  # the graph is spent: keep the value only
                outs.append(out)
        with watchdog.within("collective: all_reduce (loss and metrics)"):
            loss_sum, totals, mine = self._reduce(outs, router)
        self.moe_counts = totals.get("moe_tokens")  # the global batch's tokens per expert (bias update)
        dev.synchronize(self.device)
        return Result(
            loss=loss_sum / max(total, 1),
            count=total,
            tokens=sum(loss.tokens(b) for b in micro) * par.loss_size,
            metrics=loss.summarize(totals, total, len(micro) * par.loss_size),
            t_bwd=time.perf_counter(),
            local=None if mine is None else (mine, local),
        )

    def step(self, loss: float, judge=None, measure: bool = False) -> Update:
        """Unscale, clip and apply the gradients, then advance the schedule. A non-finite loss or
        gradient norm never reaches the weights: the update is skipped (fp16's scaler backs off).
        `judge(loss, grad_norm, scaled=)`: the guard's Verdict (ladle/train/guard.py), whose
        `skip` skips the update too. `measure`: also the update's size relative to the weights
        (`update_ratio`, ||new - old|| / ||old||; one copy of the trained weights while it runs)."""
        watchdog.phase("optimizer")
        self.precision.unscale(self.optimizer)
        with watchdog.within("collective: gradient norm"):
            grad_norm = float(
                clip_grad_norm_(self.model.parameters(), self.grad_clip, pp_group=self.parallel.pp_group)
            )
        scaled = self.precision.scaler is not None
        verdict = judge(loss, grad_norm, scaled=scaled) if judge is not None else None
        finite = math.isfinite(loss) and (math.isfinite(grad_norm) or scaled)
        ratio = None
        if finite and not (verdict is not None and verdict.skip):
            params = [p for p in self.model.parameters() if p.requires_grad] if measure else []
            before = [p.detach().clone() for p in params]
            stepped = self.precision.step(self.optimizer)
            if stepped and getattr(self, "moe_counts", None) is not None:
                update_correction_bias(self.model, self.moe_counts)
            if measure:
                ratio = self.update_ratio(before, params)
        else:
            stepped = False
            if not finite and self.precision.scaler:  # back off as it would for inf gradients
                self.precision.scaler.update(self.precision.scaler.get_scale() / 2)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step used
        self.scheduler.step()
        return Update(lr, grad_norm, finite, not stepped, verdict, ratio)

    @torch.no_grad()
    def update_ratio(self, before: list[torch.Tensor], params: list[torch.Tensor]) -> float:
        """||new - old|| / ||old|| over every trained weight (sharded ones over all their shards,
        the pipeline stages' summed), what one watches for divergence (healthy: around 1e-3)."""
        old = total_norm(before, pp_group=self.parallel.pp_group)  # every stage joins, even one without
        if before:
            torch._foreach_sub_(before, [p.detach() for p in params])  # old - new, in place
        return float(total_norm(before, pp_group=self.parallel.pp_group)) / max(float(old), 1e-30)

    def scale_lr(self, factor: float) -> None:
        """The learning rate times `factor` from now on (a rollback's): the schedule's base, so
        that it is checkpointed with the schedule, and the current one."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for g in self.optimizer.param_groups:
            g["lr"] *= factor
            if "initial_lr" in g:
                g["initial_lr"] *= factor

    @torch.no_grad()
    def evaluate(self, batches, loss: Loss) -> tuple[float, int, dict] | None:
        """(mean loss, count, summarized metrics) of `loss` over the batches, forward only; None
        when they hold nothing to count."""
        self.model.eval()
        outs, count, n = [], 0, 0
        for b in batches:
            b = self.parallel.shard_sequence(b)
            with self.parallel.loss_context(), self.precision.autocast():
                out = self.pipeline.forward_only(b, loss) if self.pipeline else loss(self.model, b)
            if out is not None:
                outs.append(out)
            count += loss.count(b)
            n += 1
        total = int(self.parallel.all_reduce_loss(torch.tensor([count], device=self.device)).item())
        loss_sum, totals, _ = self._reduce(outs)
        if total == 0:
            return None
        return loss_sum / total, total, loss.summarize(totals, total, n * self.parallel.loss_size)

    def _reduce(self, outs: list[LossOut], shares: dict | None = None) -> tuple[float, dict, float | None]:
        """The loss sum and metric sums of the microbatches, summed over the ranks of the batch
        (and the pipeline stages: only the last has them), in one all-reduce; a metric named
        `*_max` (non-negative) is a maximum instead, in a second all-reduce. `shares`: metric sums
        every pipeline stage holds a share of (an MoE model's router statistics). Also this rank's
        own loss sum (None without outputs), for the report of a bad step."""
        shapes = {k: v.shape for k, v in outs[0].metrics.items()} if outs else {}
        if self.pipeline is not None:
            shapes = self._pipeline_shapes(shapes)
        shares = shares or {}
        shapes = {**shapes, **{k: v.shape for k, v in shares.items()}}
        sums = {k: v for k, v in shapes.items() if not k.endswith("_max")}
        maxes = {k: v for k, v in shapes.items() if k.endswith("_max")}
        f64 = {"device": self.device, "dtype": torch.float64}

        def mine(k: str, combine) -> torch.Tensor:  # zeros on a stage without the loss
            if k in shares:
                return shares[k].to(**f64).flatten()
            if not outs:
                return torch.zeros(math.prod(shapes[k]), **f64)
            return combine(torch.stack([o.metrics[k].double().flatten() for o in outs]))

        loss = sum(o.sum.detach().double() for o in outs) if outs else torch.zeros((), **f64)
        packed = self._all_reduce(
            torch.cat([loss.view(1).to(**f64), *(mine(k, lambda x: x.sum(0)) for k in sums)])
        )
        totals = _unpack(packed[1:], sums)
        if maxes:
            flat = torch.cat([mine(k, lambda x: x.amax(0)) for k in maxes])
            totals.update(_unpack(self._all_reduce(flat, torch.distributed.ReduceOp.MAX), maxes))
        return float(packed[0]), totals, float(loss) if outs else None  # the last: this rank's own sum

    def _all_reduce(self, packed: torch.Tensor, op=None) -> torch.Tensor:
        self.parallel.all_reduce_pp(packed, op)
        self.parallel.all_reduce_loss(packed, op)
        return packed.cpu()

    def _pipeline_shapes(self, mine: dict) -> dict:
        """The metric shapes the last stage's loss reports, told to the other stages once."""
        key = self.model.training
        if key not in self._shapes:
            box = [mine if self.pipeline.last else None]
            last = self.pipeline.owner[self.pipeline.n_stages - 1]
            torch.distributed.broadcast_object_list(box, group=self.parallel.pp_group, group_src=last)
            self._shapes[key] = box[0]
        return self._shapes[key]

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The model's trained parameters and the optimizer's state, as DCP saves them (sharded
        as laid out; DCP reshards into any other layout on load)."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=TRAINABLE)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            # Not strict: the frozen base is not in the state (TRAINABLE). Every key that is was
            # found in the checkpoint, or the read would have failed.
            options=StateDictOptions(strict=False, ignore_frozen_params=True),
        )

    def scalars(self) -> dict:
        """The JSON part of the state: the schedule's position and the loss scale."""
        return {"scheduler": self.scheduler.state_dict(), "loss_scaler": self.precision.state_dict()}

    def load_scalars(self, d: dict) -> None:
        self.scheduler.load_state_dict(d["scheduler"])
        self.precision.load_state_dict(d.get("loss_scaler", {}))


def _unpack(flat: torch.Tensor, shapes: dict) -> dict:
    out, at = {}, 0
    for k, shape in shapes.items():
        size = math.prod(shape)
        out[k] = flat[at : at + size].view(shape)
        at += size
    return out
