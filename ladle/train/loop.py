"""The training loop, written once and shared by every recipe.

A recipe hands over a model, a loader (`next()` -> this rank's microbatches of the step,
`state_dict()`, `data_s`) and optionally its own `loss_fn`; the loop does the rest: precision,
gradient accumulation, loss normalisation over the global batch, clipping, the optimizer and
schedule, validation, checkpoints, metrics, signals and non-finite guards. Read it top to bottom
in `Trainer.fit`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import yaml

from ladle import device as dev
from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.config.load import config_hash, to_dict, to_yaml
from ladle.models.moe import expert_load_metrics, router_losses
from ladle.parallel.clip import clip_grad_norm_
from ladle.parallel.mesh import Layout, Parallel
from ladle.train import faults
from ladle.train.checkpoint import Checkpointer
from ladle.train.loss import IGNORE_INDEX, cross_entropy_sum
from ladle.train.metrics import format_line
from ladle.train.optim import build_optimizer, build_scheduler
from ladle.train.precision import Precision


def config_changes(old_yaml: Path, cfg: LadleConfig) -> list[str]:
    """`key: old -> new` for every setting that differs from the checkpoint's config."""
    if not old_yaml.is_file():
        return []

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield prefix + k, v

    old = dict(flat(yaml.safe_load(old_yaml.read_text()) or {}))
    new = dict(flat(to_dict(cfg)))
    return [
        f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v and k != "train.resume"
    ]


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps: the weights were never updated with them."""


def causal_lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of the token cross-entropies; the loop divides by the global token count."""
    logits = model(
        batch["tokens"],
        positions=batch.get("positions"),
        doc_ids=batch.get("doc_ids"),
        attention=batch.get("attention"),  # context parallelism's, with the batch's shard
    )
    return cross_entropy_sum(logits, batch["targets"], IGNORE_INDEX)


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["targets"] != IGNORE_INDEX).sum())


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
        model: torch.nn.Module,
        loader,
        *,
        flops_per_token: float,
        eval_batches: Callable[[], Iterable[dict]] | None = None,
        loss_fn: Callable = causal_lm_loss,
        parallel: Parallel | None = None,
        pipeline=None,  # ladle.parallel.pp.Pipeline: forward and backward run through its schedule
    ):
        self.cfg, self.run, self.model, self.loader = cfg, run, model, loader
        self.parallel = parallel or Parallel(Layout(), run.device)
        self.pipeline = pipeline
        self.device = run.device
        self.loss_fn = loss_fn
        self.eval_batches = eval_batches
        self.flops_per_token = flops_per_token
        self.precision = Precision(cfg.precision, self.device)
        self.optimizer = build_optimizer(model, cfg.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler, cfg.train.max_steps)
        self.checkpointer = Checkpointer(run.dir, cfg.checkpoint, self.device, log=run.events)
        self.step = 0
        self.tokens_seen = 0
        self.bad_steps = 0
        self.last_val: dict | None = None
        self.last_record: dict | None = None
        self.peak_tflops, self.peak_source = dev.peak_tflops(
            self.device, dev.compute_dtype_name(cfg.precision.mode)
        )

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.loader.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loss_scaler": self.precision.state_dict(),
            "config_hash": config_hash(self.cfg),
            "adapters_only": self.cfg.lora is not None,  # the frozen base is not in the checkpoint
            "world_size": dist.world_size(),
            "time": time.time(),
        }

    def resume_from(self, path) -> None:
        extra = self.checkpointer.load(path, self.model, self.optimizer)
        self.step = int(extra["step"])
        self.tokens_seen = int(extra["tokens_seen"])
        self.loader.load_state_dict(extra["data"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.precision.load_state_dict(extra.get("loss_scaler", {}))
        self.run.events(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens seen)")
        changed = config_changes(Path(path) / "config.yaml", self.cfg)
        if changed:
            self.run.events("resumed with changed settings: " + "; ".join(changed), level="warning")

    def save(self, *, blocking: bool = False) -> None:
        self.checkpointer.save(
            self.step, self.model, self.optimizer, self.state(), to_yaml(self.cfg), blocking=blocking
        )
        kind = (
            "async checkpoint started"
            if self.cfg.checkpoint.async_save and not blocking
            else "checkpoint saved"
        )
        self.run.events(f"{kind}: step {self.step} (loop stalled {self.checkpointer.last_stall_s:.2f}s)")

    # -- one optimizer step ----------------------------------------------------------------
    def train_step(self, micro: list[dict[str, torch.Tensor]]) -> dict:
        # The loss is the sum over the real target tokens of the whole global batch divided by
        # their number, so the gradient does not depend on how the batch is split into
        # microbatches and ranks. Data-parallel wrappers (DDP, FSDP) average gradients over the
        # ranks whose tokens differ (the data ranks, times cp: context parallelism splits each
        # sample's tokens), hence that factor; the ranks of a TP or PP group share their tokens.
        par = self.parallel
        micro = [par.shard_sequence(b) for b in micro]
        local = sum(count_targets(b) for b in micro)
        total = int(par.all_reduce_loss(torch.tensor([local], device=self.device)).item())
        scale = par.loss_size / max(total, 1)
        self.model.train()
        if self.pipeline is not None:  # the schedule runs every microbatch's forward and backward
            with par.loss_context(), self.precision.autocast():
                loss_sum, router = par.all_reduce_pp(self.pipeline.run(micro, scale)), None
        else:
            loss_sum, router = self._accumulate(micro, scale)
        loss_val = float(par.all_reduce_loss(loss_sum).item()) / max(total, 1)
        dev.synchronize(self.device)
        t_bwd = time.perf_counter()

        self.precision.unscale(self.optimizer)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        grad_norm = float(clip_grad_norm_(self.model.parameters(), clip, pp_group=par.pp_group))
        finite = math.isfinite(loss_val) and (math.isfinite(grad_norm) or self.precision.scaler is not None)
        if finite:
            stepped = self.precision.step(self.optimizer)
        else:
            stepped = False
            if self.precision.scaler:  # let the scaler back off as it would for inf gradients
                self.precision.scaler.update(self.precision.scaler.get_scale() / 2)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step used
        self.scheduler.step()
        return {
            "lr": lr,
            "loss": loss_val,
            "grad_norm": grad_norm,
            "finite": finite,
            "skipped": not stepped,
            "tokens": sum(b["tokens"].numel() for b in micro) * par.loss_size,
            "t_bwd": t_bwd,
            "router": router,
        }

    def _accumulate(self, micro: list[dict], scale: float) -> tuple[torch.Tensor, list | None]:
        """Forward and backward of each microbatch; (the sum of their token losses, the MoE
        router statistics per microbatch or None)."""
        par, moe = self.parallel, self.cfg.model.moe
        core = getattr(self.model, "module", self.model)  # unwrapped from DDP
        router = [] if moe else None  # per microbatch: (aux, z, tokens per expert (L, E))
        loss_sum = torch.zeros((), device=self.device)
        for i, b in enumerate(micro):
            # A data-parallel wrapper all-reduces gradients on the last microbatch only.
            sync = i == len(micro) - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync(), par.loss_context():
                with self.precision.autocast():
                    loss = self.loss_fn(self.model, b)
                    total_loss = loss * scale
                    if moe:
                        # Router losses are means: averaged over microbatches here and over
                        # ranks by the data-parallel gradient average.
                        stats = core.router_stats
                        total_loss = total_loss + router_losses(stats, moe) / len(micro)
                        router.append([torch.stack([s[j].detach().float() for s in stats]) for j in range(3)])
                self.precision.scale(total_loss).backward()
            loss_sum += loss.detach()
        return loss_sum, router

    def check_finite(self, out: dict) -> None:
        """A non-finite loss is reported with its step and never reaches the weights: the update
        is skipped, and after `train.max_bad_steps` in a row the run stops."""
        if out["finite"]:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        self.run.events(
            f"step {self.step}: non-finite loss ({out['loss']}) or gradient norm ({out['grad_norm']}); "
            f"update skipped ({self.bad_steps}/{self.cfg.train.max_bad_steps} in a row)",
            level="warning",
        )
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_steps} non-finite steps in a row, the last at step {self.step}; the weights hold "
                f"no update from them (last good checkpoint: {self.run.dir}/checkpoints/latest). Lower "
                "optim.lr, raise scheduler.warmup_steps, or use precision.mode=bf16-mixed"
            )

    # -- validation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if self.eval_batches is None:
            return None
        t0 = time.perf_counter()
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        for b in self.eval_batches():
            b = self.parallel.shard_sequence(b)
            with self.parallel.loss_context(), self.precision.autocast():
                if self.pipeline is not None:
                    loss_sum += self.parallel.all_reduce_pp(self.pipeline.run([b], 1.0, train=False)).double()
                else:
                    loss_sum += self.loss_fn(self.model, b).double()
            count += count_targets(b)
        self.parallel.all_reduce_loss(loss_sum)
        self.parallel.all_reduce_loss(count)
        if count.item() == 0:
            return None
        val = float(loss_sum / count)
        rec = {
            "step": self.step,
            "val_loss": val,
            "val_ppl": math.exp(min(val, 50.0)),
            "eval_s": time.perf_counter() - t0,
        }
        self.run.metrics.write(rec)
        self.last_val = rec
        return rec

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> str:
        """Trains to train.max_steps; returns 'completed', 'exit' (train.exit_at_step or the time
        limit) or the name of the signal that stopped it."""
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
            while self.step < t.max_steps:
                t0 = time.perf_counter()
                micro = self.loader.next()
                t_data = time.perf_counter()
                out = self.train_step(micro)
                dev.synchronize(self.device)
                t_end = time.perf_counter()
                self.step += 1
                self.tokens_seen += out["tokens"]
                self.check_finite(out)
                faults.at("step", self.step)

                window["steps"] += 1
                window["tokens"] += out["tokens"]
                window["step_s"] += t_end - t0
                window["data_s"] += self.loader.data_s
                window["fwd_bwd_s"] += out["t_bwd"] - t_data
                window["optim_s"] += t_end - out["t_bwd"]
                bar.update(self.step, out["loss"])
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    self.log_step(out, window, bar)
                    window = _new_window()
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                    self.report_eval(bar)
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
        if status == "completed":
            self.report_eval(bar)
        self.save(blocking=True)
        if status != "completed":
            run.events(
                f"stopped at step {self.step} ({status}); checkpoint saved. Continue with train.resume=auto",
                level="warning",
            )
        return status

    def report_eval(self, bar) -> None:
        if self.cfg.train.eval_steps == 0:
            return
        rec = self.evaluate()
        if rec:
            bar.print(
                f"step {rec['step']:>6} | val_loss {rec['val_loss']:.4f} | val_ppl {rec['val_ppl']:.2f}"
            )

    def log_step(self, out: dict, window: dict, bar) -> None:
        n = max(1, window["steps"])
        tps = window["tokens"] / max(window["step_s"], 1e-9)
        mfu = tps * self.flops_per_token / (self.peak_tflops * 1e12 * dist.world_size())
        rec = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": out["loss"],
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "tokens_per_s": tps,
            "mfu": mfu,
            "step_s": window["step_s"] / n,
            "data_s": window["data_s"] / n,
            "fwd_bwd_s": window["fwd_bwd_s"] / n,
            "optim_s": window["optim_s"] / n,
            "mem_peak_bytes": dev.peak_memory_bytes(self.device),
            "skipped": out["skipped"],
        }
        if self.precision.loss_scale is not None:
            rec["loss_scale"] = self.precision.loss_scale
        if out["router"]:
            rec.update(expert_load_metrics(out["router"]))
        self.run.metrics.write(rec)
        self.last_record = rec
        bar.print(format_line(rec))


def _new_window() -> dict:
    """Sums over the steps since the last logged one (timings are reported as their means)."""
    return {"steps": 0, "tokens": 0, "step_s": 0.0, "data_s": 0.0, "fwd_bwd_s": 0.0, "optim_s": 0.0}
