"""What a run records: `metrics.jsonl`, `events.log`, the console line and progress bar, and MFU."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ladle import distributed as dist
from ladle.config import LadleConfig
from ladle.models.llama import Llama
from ladle.models.lora import apply_lora


def flops_per_token(
    n_params_no_embedding: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6·N for the matmuls with weights (forward + backward) plus
    12·L·H·Q·T for attention scores and values (PaLM, appendix B), N without the input embedding."""
    return 6 * n_params_no_embedding + 12 * n_layers * n_heads * head_dim * seq_len


class EventLog:
    """`events.log`: human-readable notable events of every rank, each line tagged with its rank."""

    def __init__(self, run_dir: Path, console: Console | None = None, echo: bool = True):
        self.path = Path(run_dir) / "events.log"
        self.console = console
        self.echo = echo and dist.is_main()

    def __call__(self, msg: str, *, level: str = "info", echo: bool = True) -> None:
        """echo=False: the file only (what the console has already shown in its own form)."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{stamp} [rank {dist.rank()}] {level.upper()}: {msg}\n"
        with open(self.path, "a") as f:
            f.write(line)
        if self.echo and echo:
            style = {"warning": "yellow", "error": "bold red"}.get(level, "dim")
            (self.console or Console(stderr=True)).print(f"[{style}]{msg}[/{style}]", highlight=False)


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and hands it to the enabled
    loggers (TensorBoard, W&B: ladle/train/loggers.py); rank 0 only."""

    def __init__(self, run_dir: Path, loggers=None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = dist.is_main()
        self.loggers = loggers

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.loggers is not None:
            self.loggers.log(record)

    def close(self) -> None:
        if self.loggers is not None:
            self.loggers.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_line(r: dict, console: tuple[str, ...] = ()) -> str:
    """The console line of a logged step; `console`: the recipe's metrics to show (its loss's)."""
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}" if r.get("loss") is not None else "loss nan"]
    parts += [
        f"lr {r['lr']:.2e}",
        f"gnorm {r['grad_norm']:.3f}" if r.get("grad_norm") is not None else "gnorm nan",
    ]
    parts += [
        f"{r['tokens_per_s']:,.0f} tok/s",
        f"mfu {100 * r['mfu']:.1f}%",
        f"step {r['step_s'] * 1000:.0f}ms",
    ]
    parts.append(f"data {r['data_s'] * 1000:.0f}ms")
    if r.get("loss_scale") is not None:
        parts.append(f"scale {r['loss_scale']:.0f}")
    parts += [f"{k.replace('_', ' ')} {r[k]:.4g}" for k in console if r.get(k) is not None]
    return " | ".join(parts)


class ConsoleProgress:
    """A rich progress bar with ETA (on a terminal) and a console line every `log_every` steps."""

    def __init__(self, total_steps: int, start_step: int, console: Console):
        self.console = console
        self.enabled = dist.is_main()
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not (self.enabled and console.is_terminal),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, step: int, loss: float | None) -> None:
        self.progress.update(self.task, completed=step, loss=f"loss {loss:.4f}" if loss is not None else "")

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)


def make_console() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def model_flops(cfg: LadleConfig, n_no_embed: int) -> tuple[float, str]:
    """(training FLOPs per token for MFU, what an adapter run trains, for the log)."""
    m = cfg.model
    fpt = flops_per_token(n_no_embed, m.n_layers, m.n_heads, m.head_size, cfg.data.seq_len)
    if cfg.lora is None:
        return fpt, ""
    n_trained, n_adapters, frozen = adapter_counts(cfg, n_no_embed)
    saved = f" and {', '.join(cfg.lora.modules_to_save)} in full" if cfg.lora.modules_to_save else ""
    return (
        fpt + 6 * n_adapters - 2 * frozen,
        f", {n_trained:,} trained (adapters{saved}; MFU counts 4 FLOPs a token for a frozen weight)",
    )


def adapter_counts(cfg: LadleConfig, n_no_embed: int) -> tuple[int, int, int]:
    """(trained parameters, adapter parameters, frozen weights among MFU's N = n_no_embed) of an
    adapter run, counted on a meta-device copy (so for any layout). A frozen weight costs no
    weight gradient: 4 FLOPs a token instead of 6; the adapters are matmul weights of their own."""
    with torch.device("meta"):
        meta = Llama(cfg.model)
    apply_lora(meta, cfg.lora)
    trained = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    adapters = sum(p.numel() for n, p in meta.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    head = meta.embed_tokens.weight if cfg.model.tie_embeddings else meta.lm_head.weight
    return trained, adapters, n_no_embed - (head.numel() if head.requires_grad else 0)
