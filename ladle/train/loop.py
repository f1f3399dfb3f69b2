"""The training loop's cadence, written once and shared by every recipe.

A recipe hands over a trainable unit (ladle/train/unit.py: its model, optimizer, schedule,
precision and clipping), a loader (`next()` -> this rank's microbatches of the step,
`state_dict()`, `data_s`), a loss object (ladle/train/loss.py) and any other stateful parts to
checkpoint. The loop decides when things happen: a step, the console line and metrics.jsonl
(with the loss's own metrics), validation, checkpoints, signals, and what a bad step leads to
(ladle/train/guard.py judges it: an event naming the samples, a skip, a rollback or a stop).
Read it top to bottom in `Trainer.fit`; a recipe whose step is more than forward, backward and
update overrides `train_step`.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ladle import device as dev
from ladle import distributed as dist
from ladle import faults, watchdog
from ladle.checkpoint.catalogue import POLICY, latest_checkpoint, read_config
from ladle.checkpoint.dcp import Checkpointer
from ladle.config import LadleConfig
from ladle.config.load import config_hash, to_dict, to_yaml
from ladle.data.folder import data_identity
from ladle.train.guard import NONFINITE, OK, Guard, Verdict
from ladle.train.loss import Loss
from ladle.train.metrics import format_line
from ladle.train.profile import Profiler, Warnings, table
from ladle.train.unit import TrainUnit


def config_changes(ckpt: Path, cfg: LadleConfig) -> list[str]:
    """`key: old -> new` for every setting that differs from the checkpoint's config."""

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield prefix + k, v

    old = dict(flat(read_config(ckpt)))
    new = dict(flat(to_dict(cfg)))
    return [
        f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v and k != "train.resume"
    ]


@dataclass
class StepResult:
    """One step as the loop logs and judges it: the unit's forward and backward over the global
    batch, its update, and the loss's (and a recipe's) metrics by name."""

    loss: float
    tokens: int  # of the global batch, padding included
    t_bwd: float  # perf_counter when backward ended (the step-time breakdown)
    lr: float
    grad_norm: float
    finite: bool
    skipped: bool
    metrics: dict = field(default_factory=dict)
    local: tuple[float, int] | None = None  # this rank's loss sum and count (a bad step's report)
    verdict: Verdict | None = None
    update_ratio: float | None = None  # on a logged step


class TrainingDiverged(RuntimeError):
    """Too many bad steps in a row (non-finite, or skipped spikes), and no rollback left: the
    weights were never updated with them."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory; the message holds the report (`oom_report`: ladle.plan's)."""


class StopSignal:
    """SIGTERM / SIGINT set a flag the loop checks after each step (checkpoint, then a clean
    exit). A second Ctrl-C interrupts at once."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}

    def _handler(self, signum, frame):
        if self.received == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. a test runner thread)
                pass
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class Trainer:
    def __init__(
        self,
        cfg: LadleConfig,
        run,  # ladle.train.run.RunDir
        unit: TrainUnit,
        loader,
        loss: Loss,
        *,
        flops_per_token: float,
        eval_batches: Callable[[], Iterable[dict]] | None = None,
        parts: dict | None = None,  # other stateful parts to checkpoint, by name (a value model)
        name: str = POLICY,  # the unit's part in checkpoints (a group of a separated placement: "critic")
        identity: dict | None = None,  # data.folder.data_identity, when the caller has it
        oom_report: Callable[[int, int], str] | None = None,  # (rank, step) -> the report (ladle/plan)
        # eval.harness: (model, step) -> {"harness/<task>/<metric>": value} on rank 0, None
        # elsewhere; every rank calls it (the weights are gathered), rank 0 scores
        harness: Callable[[torch.nn.Module, int], dict | None] | None = None,
    ):
        self.cfg, self.run, self.unit, self.loader, self.loss = cfg, run, unit, loader, loss
        self.parallel = unit.parallel
        self.device = run.device
        self.eval_batches = eval_batches
        self.flops_per_token = flops_per_token
        self.parts = {name: unit, **(parts or {})}
        self.checkpointer = Checkpointer(run.dir, cfg.checkpoint, self.device, log=run.events)
        self.drill = faults.Drill(cfg.faults, dist.rank())  # faults.* switches: off unless enabled
        self.profiler = Profiler(cfg.profiler, self.run.dir, self.device, dist.rank())
        self.warnings = Warnings(cfg.profiler, accelerator=self.device.type != "cpu")
        self.name = name
        self.oom_report = oom_report
        self.harness = harness
        self.identity = identity or data_identity(cfg)  # the tokenizer and data, which a resume compares
        self.guard = Guard(cfg.guard)  # judges the policy's steps (a critic's only skips non-finite ones)
        self.step = 0
        self.tokens_seen = 0
        self.last_val: dict | None = None
        self.last_record: dict | None = None
        self.recipe_metrics: dict = {}  # the loss's metrics of the last logged step
        self.peak_tflops, self.peak_source = dev.peak_tflops(
            self.device, dev.compute_dtype_name(cfg.precision.mode)
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.unit.model

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict:
        """The JSON part of a checkpoint (trainer_state.json); the policy's scalars at the top."""
        units = {k: p.scalars() for k, p in self.parts.items() if hasattr(p, "scalars")}
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.loader.state_dict(),
            **units.pop(POLICY, {}),
            "guard": self.guard.state_dict(),
            "data_identity": self.identity,
            "config_hash": config_hash(self.cfg),
            "adapters_only": self.cfg.lora is not None,  # the frozen base is not in the checkpoint
            "world_size": dist.world_size(),
            "time": time.time(),
        }
        if units:
            state["units"] = units
        return state

    def resume_from(self, path) -> None:
        extra = self.checkpointer.load(path, self.parts)
        self.step = int(extra["step"])
        self.tokens_seen = int(extra["tokens_seen"])
        self.loader.load_state_dict(extra["data"])
        self.guard.load_state_dict(extra.get("guard", {}))
        for name, part in self.parts.items():
            scalars = extra if name == POLICY else extra.get("units", {}).get(name)
            if scalars is not None and hasattr(part, "load_scalars"):
                part.load_scalars(scalars)
        self.run.events(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens seen)")
        changed = config_changes(Path(path), self.cfg)
        if changed:
            self.run.events("resumed with changed settings: " + "; ".join(changed), level="warning")

    def save(self, *, blocking: bool = False) -> None:
        watchdog.phase("checkpoint")
        self.checkpointer.save(self.step, self.parts, self.state(), to_yaml(self.cfg), blocking=blocking)
        kind = (
            "async checkpoint started"
            if self.cfg.checkpoint.async_save and not blocking
            else "checkpoint saved"
        )
        self.run.events(f"{kind}: step {self.step} (loop stalled {self.checkpointer.last_stall_s:.2f}s)")

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> StepResult:
        """Forward and backward of the step's microbatches, then the update (unless the guard
        skips it)."""
        result = self.unit.forward_backward(micro, self.loss, self.drill.at(self.step + 1))
        t = self.cfg.train
        logged = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.max_steps
        judge = self.guard.judge if self.name == POLICY else None
        u = self.unit.step(result.loss, judge=judge, measure=logged)
        return StepResult(
            result.loss,
            result.tokens,
            result.t_bwd,
            u.lr,
            u.grad_norm,
            u.finite,
            u.skipped,
            result.metrics,
            result.local,
            u.verdict,
            u.update_ratio,
        )

    def after_step(self, out: StepResult) -> bool:
        """A bad step (ladle/train/guard.py) is an event naming the samples of its batch and the
        rank whose loss went wrong; after `guard.max_skips` skipped updates in a row the run rolls
        back to the last checkpoint (returns True), or stops with the report (TrainingDiverged)."""
        v = out.verdict or Verdict()
        if not out.finite and v.kind != NONFINITE:  # a unit without a judge (PPO's critic)
            v = Verdict(NONFINITE, f"non-finite loss ({out.loss}) or gradient norm ({out.grad_norm})", True)
        skipped = v.skip or not out.finite
        if v.kind == OK:
            self.guard.skips = 0
            return False
        g = self.guard
        g.skips = g.skips + 1 if skipped else 0
        report = self.batch_report(out, v)
        what = f"update skipped ({g.skips}/{g.cfg.max_skips} in a row)" if skipped else "update applied"
        if dist.is_main():  # the report is every rank's, gathered: once is enough
            self.run.events(f"step {self.step}: {v.why}; {what}. {report}", level="warning")
        if g.skips < g.cfg.max_skips:
            return False
        self.recover(f"{g.skips} skipped steps in a row, the last at step {self.step} ({v.why}). {report}")
        return True

    def batch_report(self, out: StepResult, v: Verdict) -> str:
        """Which rank's loss went wrong, over which samples: every rank's loss sum and the sample
        indices its loader gave it, gathered (every rank reaches a bad step alike)."""
        mine = {
            "rank": dist.rank(),
            "local": out.local if self.name == POLICY else None,  # a critic's loss is not comparable
            "samples": self.loader.batch_samples() if hasattr(self.loader, "batch_samples") else None,
        }
        every = dist.all_gather_objects(mine)
        with_loss = [r for r in every if r["local"] is not None]
        if v.kind == NONFINITE:
            bad = [r for r in with_loss if not math.isfinite(r["local"][0])]
            head = (
                "non-finite loss on " if bad else "the loss is finite on every rank (the gradients are not); "
            )
        else:
            top = max(with_loss, key=lambda r: r["local"][0] / max(r["local"][1], 1), default=None)
            bad = [top] if top is not None else []
            head = "highest loss on " if bad else ""
        parts = []
        for r in (bad or [r for r in every if r["samples"]])[:8]:
            loss = ""
            if r["local"] is not None:
                loss = f" (loss {r['local'][0] / max(r['local'][1], 1):.4g} over {r['local'][1]} targets)"
            parts.append(f"rank {r['rank']}{loss}: {describe_samples(r['samples'], self.cfg.data.path)}")
        return (head if bad else head + "samples by rank: ") + "; ".join(parts)

    def recover(self, report: str) -> None:
        """Too many skips in a row: roll back to the last checkpoint (the weights, optimizer and
        schedule of that step, the lr times guard.rollback_lr_factor) and go on reading after the
        data that led here, or stop with the report."""
        g = self.guard.cfg
        self.checkpointer.wait()
        last = latest_checkpoint(self.run.dir)
        why = None
        if g.on_max_skips == "stop":
            why = "guard.on_max_skips=stop"
        elif last is None:
            why = "no checkpoint to roll back to"
        elif self.guard.rollbacks >= g.max_rollbacks:
            why = f"{self.guard.rollbacks} rollbacks already (guard.max_rollbacks)"
        if why is not None:
            raise TrainingDiverged(
                f"{report} Stopped ({why}); the weights hold no update from the skipped steps "
                f"(last good checkpoint: {last or 'none'}). Look at the samples with `ladle data "
                "show`; lower optim.lr, raise scheduler.warmup_steps, keep train.grad_clip on, or use "
                "precision.mode=bf16-mixed"
            )
        data, done, at = self.loader.state_dict(), self.guard.rollbacks + 1, self.step
        self.resume_from(last)
        self.loader.load_state_dict(data)  # on past the batches since the checkpoint
        self.guard.rollbacks = done
        if g.rollback_lr_factor != 1.0:
            for part in self.parts.values():
                if hasattr(part, "scale_lr"):
                    part.scale_lr(g.rollback_lr_factor)
        self.run.trim_metrics(self.step)
        self.run.events(
            f"rolled back from step {at} to {last.name} (rollback {done}/{g.max_rollbacks})"
            + (f", lr x {g.rollback_lr_factor:g}" if g.rollback_lr_factor != 1.0 else "")
            + "; the data read since that checkpoint is skipped",
            level="warning",
        )

    # -- validation --------------------------------------------------------------------------
    def evaluate(self) -> dict | None:
        if self.eval_batches is None:
            return None
        watchdog.phase("validation")
        t0 = time.perf_counter()
        if hasattr(self.loader, "validate"):  # a policy's validation is its own (RL: rewards), not a loss
            rec = {
                "step": self.step,
                **{f"val_{k}": v for k, v in self.loader.validate(self.eval_batches()).items()},
            }
        else:
            got = self.unit.evaluate(self.eval_batches(), self.loss)
            if got is None:
                return None
            val, _, metrics = got
            rec = {"step": self.step, "val_loss": val}
            if self.loss.perplexity:
                rec["val_ppl"] = math.exp(min(val, 50.0))
            rec.update({f"val_{k}": v for k, v in metrics.items()})
        rec["eval_s"] = time.perf_counter() - t0
        self.run.metrics.write(rec)
        self.last_val = rec
        return rec

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> str:
        """Trains to train.max_steps; returns 'completed', 'exit' (train.exit_at_step or the time
        limit) or the name of the signal that stopped it. The hang watchdog watches it all, the
        last validation and checkpoint too. An out-of-memory error on this rank is reported
        (memory now, the planner's breakdown, the remedies) in events.log and stops the run
        (OutOfMemory); the other ranks stop at their next collective, or the watchdog's."""
        with self.hang_watchdog():
            try:
                return self._fit()
            except torch.OutOfMemoryError as e:
                text = f"out of memory on rank {dist.rank()} in step {self.step + 1}"
                try:
                    text = self.oom_report(dist.rank(), self.step + 1) if self.oom_report else text
                except Exception as why:  # the report must not hide the error it reports
                    text = f"{text} ({why!r} in the report)"
                self.run.events(text, level="error")
                raise OutOfMemory(text) from e

    def _fit(self) -> str:
        cfg, t = self.cfg, self.cfg.train
        run = self.run
        start = time.time()
        window = _new_window()
        status = "completed"
        if self.step >= t.max_steps:
            run.events(f"already at step {self.step} >= train.max_steps; nothing to train")
            return status
        run.events(
            f"training from step {self.step} to {t.max_steps}; global batch "
            f"{t.micro_batch_size * t.grad_accum_steps * self.parallel.dp_size} x {cfg.data.seq_len} tokens; "
            f"layout {self.parallel.layout.describe()}; "
            f"MFU peak {self.peak_tflops:.2f} TFLOP/s ({self.peak_source})"
        )
        dev.reset_peak_memory(self.device)
        with StopSignal() as stop, run.progress(t.max_steps, self.step) as bar:
            if t.eval_at_start and self.step == 0:
                self.report_eval(bar)
            while self.step < t.max_steps:
                self.profiler.before(self.step + 1)
                t0 = time.perf_counter()
                watchdog.phase("data", step=self.step + 1)
                micro = self.loader.next()
                t_data = time.perf_counter()
                out = self.train_step(micro)
                dev.synchronize(self.device)
                t_end = time.perf_counter()
                self.step += 1
                self.tokens_seen += out.tokens
                if self.after_step(out):  # rolled back: the loop goes on from the checkpoint's step
                    window = _new_window()
                    continue
                watchdog.step_done(self.step)
                faults.at("step", self.step)
                self.drill.after(self.step)

                timers = {
                    "step_s": t_end - t0,
                    "data_s": self.loader.data_s,
                    "gen_s": getattr(self.loader, "gen_s", 0.0),  # the RL recipes' rollouts
                    "fwd_bwd_s": out.t_bwd - t_data,
                    "optim_s": t_end - out.t_bwd,
                }
                window["steps"] += 1
                window["tokens"] += out.tokens
                for k, v in timers.items():
                    window[k] += v
                self.report_profile(self.profiler.after(self.step, timers), bar)
                bar.update(self.step, out.loss)
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    self.log_step(out, window, bar)
                    window = _new_window()
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                    self.report_eval(bar)
                every = cfg.eval.harness_every
                if every and self.step % every == 0 and self.step < t.max_steps:
                    self.report_harness(bar)
                self.checkpointer.poll()

                reason = stop.received
                if t.exit_at_step and self.step >= t.exit_at_step:
                    reason = reason or "exit"
                if t.exit_after_minutes and (time.time() - start) / 60 >= t.exit_after_minutes:
                    reason = reason or "exit"
                if dist.any_rank(reason is not None, self.device):
                    status = reason or "signal"
                    break
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < t.max_steps:
                    self.save()
        self.loader.close()
        self.report_profile(self.profiler.finish(self.step), bar)  # a profile the run ended within
        if status == "completed":
            self.report_eval(bar)
            self.report_harness(bar)
        self.save(blocking=True)
        if status != "completed":
            run.events(
                f"stopped at step {self.step} ({status}); checkpoint saved. Continue with train.resume=auto",
                level="warning",
            )
        return status

    def hang_watchdog(self) -> watchdog.Watchdog:
        """The hang watchdog's thread for this rank, while the loop runs (ladle/watchdog.py)."""
        folder = self.run.dir / "hang"
        if dist.is_main() and self.cfg.watchdog.timeout_s and "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ:
            self.run.events(
                f"NCCL flight recorder on: a collective timeout dumps to {folder}/nccl_trace_rank_*"
            )
        return watchdog.Watchdog(
            folder,
            self.cfg.watchdog.timeout_s,
            self.cfg.dist.timeout_s,
            rank=dist.rank(),
            world=dist.world_size(),
            store=dist.store(),
            log=lambda msg: self.run.events(msg, level="error"),
        )

    def report_eval(self, bar) -> None:
        if self.cfg.train.eval_steps == 0:
            return
        rec = self.evaluate()
        if rec:
            shown = [f"step {rec['step']:>6}"]
            shown += [f"val_loss {rec['val_loss']:.4f}"] if "val_loss" in rec else []
            shown += [f"val_ppl {rec['val_ppl']:.2f}"] if "val_ppl" in rec else []
            console = (*self.loss.console, *getattr(self.loader, "console", ()))
            shown += [f"val_{k} {rec[f'val_{k}']:.4g}" for k in console if f"val_{k}" in rec]
            bar.print(" | ".join(shown))

    def report_harness(self, bar) -> None:
        """eval.harness's tasks on the gathered weights (ladle/ops/harness.py): metrics.jsonl gets
        `harness/<task>/<metric>` at this step, and so TensorBoard and W&B."""
        if self.harness is None:
            return
        watchdog.phase("harness", step=self.step)
        rec = self.harness(self.model, self.step)
        if rec:
            self.run.metrics.write({"step": self.step, **rec})
            shown = [
                f"{k.removeprefix('harness/')} {v:.4g}" for k, v in rec.items() if k.startswith("harness/")
            ]
            bar.print(" | ".join([f"step {self.step:>6}", *shown]))

    def report_profile(self, result: dict | None, bar) -> None:
        """The profiled steps' breakdown: on the console, in events.log and the run card (rank 0)."""
        if result is None or not dist.is_main():
            return
        text = table(result, self.profiler.first, self.profiler.last)
        bar.print(text)
        self.run.events(f"{text}\ntraces: {self.run.dir / 'profile'}", echo=False)
        self.run.write_card(profile={k: v for k, v in result.items()})

    def log_step(self, out: StepResult, window: dict, bar) -> None:
        n = max(1, window["steps"])
        tps = window["tokens"] / max(window["step_s"], 1e-9)
        mfu = tps * self.flops_per_token / (self.peak_tflops * 1e12 * dist.world_size())
        rec = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": out.loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            "tokens_per_s": tps,
            "mfu": mfu,
            "step_s": window["step_s"] / n,
            "data_s": window["data_s"] / n,
            "fwd_bwd_s": window["fwd_bwd_s"] / n,
            "optim_s": window["optim_s"] / n,
            "mem_peak_bytes": dev.peak_memory_bytes(self.device),
            "skipped": out.skipped,
        }
        reserved = dev.peak_reserved_bytes(self.device)
        if reserved is not None:  # the allocator's reserved peak: with mem_peak_bytes, fragmentation
            rec["mem_reserved_bytes"] = reserved
        if out.update_ratio is not None:
            rec["update_ratio"] = out.update_ratio
        if self.unit.precision.loss_scale is not None:
            rec["loss_scale"] = self.unit.precision.loss_scale
        # the recipe's own, by the names its loss (and a loader that makes rollouts) gives them
        extra = self.loader.step_metrics() if hasattr(self.loader, "step_metrics") else {}
        rec.update(out.metrics)
        rec.update(extra)
        self.run.metrics.write(rec)
        if dist.is_main():
            for msg in self.warnings.check(rec):
                self.run.events(msg, level="warning")
        self.last_record = rec
        self.recipe_metrics = {**out.metrics, **extra}
        bar.print(format_line(rec, (*self.loss.console, *getattr(self.loader, "console", ()))))


def describe_samples(s: dict | None, data_dir: str) -> str:
    """A loader's `batch_samples()` as the report says it, with the command that shows them."""
    if not s:
        return "no samples here (another rank of its group reads them)"
    if "sources" in s:  # a mixture's: each source's samples, with its own folder
        return "; ".join(
            f"data.mix source {name}: "
            + describe_samples({**d, "split": s["split"], "what": s["what"]}, d["path"])
            for name, d in s["sources"].items()
        )
    docs = s.get("documents") or []
    shown = ", ".join(map(str, docs[:32])) + (f" and {len(docs) - 32} more" if len(docs) > 32 else "")
    show = " ".join(map(str, docs[:32])) + (f" --split {s['split']}" if s["split"] != "train" else "")
    return (
        f"samples {s['samples']} of the {s['split']} split ({s['what']} {shown}; "
        f"see them with `ladle data show {data_dir} {show}`)"
    )


def _new_window() -> dict:
    """Sums over the steps since the last logged one (timings are reported as their means)."""
    return {
        "steps": 0,
        "tokens": 0,
        "step_s": 0.0,
        "data_s": 0.0,
        "gen_s": 0.0,
        "fwd_bwd_s": 0.0,
        "optim_s": 0.0,
    }
