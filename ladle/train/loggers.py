"""Optional metric loggers beside `metrics.jsonl`: TensorBoard and Weights & Biases (`loggers.*`).

Rank 0 sends every numeric value of each metrics.jsonl record, under the same name and at the
same step, to each enabled logger: what one reads in TensorBoard or W&B is what the file holds.
TensorBoard writes event files to `OUTPUT_DIR/tensorboard/`; W&B runs offline by default (its
files under `OUTPUT_DIR/wandb/`, `wandb sync` uploads them later), with the run's config, and a
run id derived from the output directory so that a resumed run continues the same W&B run.
Both are extras: `pip install 'ladle[tensorboard]'` / `'ladle[wandb]'`; a config that asks for
one that is not installed is refused before the run starts (`check`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from pathlib import Path

from ladle.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check(cfg) -> None:
    """Refuses a logger whose package is missing (cfg: the run's LadleConfig)."""
    for name, package in PACKAGES.items():
        if getattr(cfg.loggers, name) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"loggers.{name}=true needs the {package} package: pip install 'ladle[{name}]', "
                f"or set loggers.{name}=false"
            )


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a metrics record, step left out (it is the x axis)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class Loggers:
    def __init__(self, cfg, run_dir: Path):
        self.sinks = []
        c = cfg.loggers
        if c.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            self.sinks.append(_TensorBoard(writer))
        if c.wandb:
            self.sinks.append(_WandB(cfg, run_dir))

    def log(self, record: dict) -> None:
        values = scalars(record)
        for sink in self.sinks:
            sink.log(values, int(record["step"]))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, cfg, run_dir: Path):
        import wandb

        c = cfg.loggers
        os.environ.setdefault("WANDB_SILENT", "true")
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            mode=c.wandb_mode,
            project=c.wandb_project,
            name=c.wandb_name or run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=cfg.model_dump(mode="json"),
        )

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
