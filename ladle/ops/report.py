"""`ladle report RUN_DIR` and `ladle compare RUN_A RUN_B ...`: plots and one self-contained page.

report: PNG plots of what metrics.jsonl holds (loss with validation loss, learning rate,
throughput, MFU, memory allocated and reserved, the step time split into data wait, forward and
backward, optimizer; every other metric a recipe logs: rewards, KL, entropy ... of the RL
recipes) into RUN_DIR/report/, and index.html with the summary, the plots inlined, the run card
and the config: one file that opens anywhere.

compare: the config keys that differ between runs (nothing else), a table of summary metrics and
the loss curves overlaid, printed and as RUN_A/compare.html (or --output).

Plots need matplotlib (`pip install 'ladle[report]'`).
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path

import yaml

from ladle.errors import ConfigError

STANDARD = {
    "step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_s", "data_s", "fwd_bwd_s",
    "optim_s", "mem_peak_bytes", "mem_reserved_bytes", "skipped", "update_ratio", "loss_scale", "val_loss",
    "val_ppl", "eval_s",
}  # fmt: skip
MIX_PREFIXES = {"loss", "samples", "epochs"}  # a data mixture's metrics, `<prefix>/<source>`


class Run:
    """A run directory as `ladle run` leaves it; a ConfigError naming what is missing otherwise."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        metrics = self.dir / "metrics.jsonl"
        if not self.dir.is_dir() or not metrics.is_file() or not (self.dir / "config.yaml").is_file():
            raise ConfigError(
                f"{path} is not a run directory: it needs the metrics.jsonl and config.yaml that "
                "`ladle run` writes into output_dir"
            )
        self.records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        self.config = yaml.safe_load((self.dir / "config.yaml").read_text()) or {}
        card = self.dir / "run_card.json"
        self.card = json.loads(card.read_text()) if card.is_file() else {}
        self.name = (
            self.dir.name if self.dir.name not in ("run", "") else f"{self.dir.parent.name}/{self.dir.name}"
        )

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    def summary(self) -> dict:
        train, val = self.train, [r for r in self.records if "val_loss" in r]
        steady = train[1:] or train
        out = {"steps": train[-1]["step"] if train else 0}
        if train:
            out["final loss"] = train[-1]["loss"]
        if val:
            out["final val loss"] = val[-1]["val_loss"]
            out["best val loss"] = min(r["val_loss"] for r in val)
        for key, name in (
            ("tokens_per_s", "tokens/s (median)"),
            ("mfu", "MFU (median)"),
            ("step_s", "step s (median)"),
        ):
            vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
            if vals:
                out[name] = statistics.median(vals)
        peaks = [r["mem_peak_bytes"] for r in train if r.get("mem_peak_bytes")]
        if peaks:
            out["peak memory GiB"] = max(peaks) / 2**30
        if self.card.get("status"):
            out["status"] = self.card["status"]
        return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'ladle[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(plt, title: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(plt, fig, ax, path: Path) -> Path:
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plots(run: Run, out: Path) -> list[Path]:
    """The run's PNGs in `out` (only those its records have data for)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    made = []

    def line(name, title, ylabel, keys, scale=1.0, log=False):
        series = [(k, *run.series(k)) for k in keys]
        series = [(k, x, y) for k, x, y in series if x]
        if not series:
            return
        fig, ax = _figure(plt, title, ylabel)
        for k, x, y in series:
            ax.plot(x, [v * scale for v in y], marker="o" if len(x) < 30 else None, ms=3, label=k)
        if log:
            ax.set_yscale("log")
        made.append(_save(plt, fig, ax, out / f"{name}.png"))

    line("loss", "loss", "loss", ["loss", "val_loss"])
    line("lr", "learning rate", "lr", ["lr"])
    line("throughput", "throughput", "tokens/s", ["tokens_per_s"])
    line("mfu", "model FLOPs utilisation", "MFU", ["mfu"])
    line("memory", "memory", "GiB", ["mem_peak_bytes", "mem_reserved_bytes"], scale=1 / 2**30)
    x, _ = run.series("step_s")
    if x:  # the step time, stacked by where it went
        fig, ax = _figure(plt, "step time", "seconds")
        parts = [run.series(k)[1] for k in ("data_s", "fwd_bwd_s", "optim_s")]
        if all(len(p) == len(x) for p in parts):
            ax.stackplot(x, *parts, labels=["data wait", "forward + backward", "optimizer"], alpha=0.8)
        ax.plot(x, run.series("step_s")[1], color="black", lw=1, label="step")
        made.append(_save(plt, fig, ax, out / "step_time.png"))
    others = sorted(
        {k for r in run.records for k, v in r.items() if k not in STANDARD and isinstance(v, (int, float))}
    )
    groups: dict[str, list[str]] = {}  # `prefix/name`: one plot per prefix (a mixture's sources, ...)
    for k in others:
        if "/" in k:
            prefix = k.split("/")[0]
            if prefix == "harness":  # harness/<task>/<metric>: a plot per task, its metrics together
                prefix = "harness_" + k.split("/")[1]
            groups.setdefault("loss" if prefix == "val_loss" else prefix, []).append(k)
        elif len(run.series(k)[0]) >= 2:  # the recipe's own: rewards, KL, entropy, expert load ...
            line(f"metric_{k}", k, k, [k])
    for prefix, keys in groups.items():
        line(f"by_{prefix}", f"{prefix} by source" if prefix in MIX_PREFIXES else prefix, prefix, keys)
    return made


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}"></figure>'


def _table(rows: list[list], head: list[str]) -> str:
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))  # noqa: E731
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows]
    return "\n".join(out) + "</table>"


# The page checks itself: every plot decoded, the count in <body data-plots> (the browser test reads it).
CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const ok = imgs.filter((i) => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.plots = ok + "/" + imgs.length;
});
</script>"""

STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
figure { display: inline-block; margin: 0.5em; } img { max-width: 680px; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
</style>"""


def page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"{STYLE}</head>\n<body>\n<h1>{html.escape(title)}</h1>\n{body}\n{CHECK}\n</body></html>\n"
    )


def report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Writes the plots and index.html; returns the page's path."""
    run = Run(run_dir)
    out = Path(output) if output else run.dir / "report"
    pngs = plots(run, out)
    summary = _table([[k, v] for k, v in run.summary().items()], ["", run.name])
    body = [
        f"<p>{html.escape(str(run.dir.resolve()))}: recipe {html.escape(str(run.card.get('recipe', '?')))}</p>",
        "<h2>Summary</h2>", summary,
        "<h2>Plots</h2>", "".join(_img(p) for p in pngs),
        *_rollouts(run),
        "<h2>Run card</h2>", f"<pre>{html.escape(json.dumps(run.card, indent=2, default=str), quote=False)}</pre>",
        "<h2>Config</h2>", f"<pre>{html.escape(yaml.safe_dump(run.config, sort_keys=False), quote=False)}</pre>",
    ]  # fmt: skip
    index = out / "index.html"
    index.write_text(page(f"ladle run {run.name}", "\n".join(body)))
    return index


def _rollouts(run: Run, last: int = 3) -> list[str]:
    """The last few episodes of an RL run's rollouts.jsonl (`log_rollouts`): step, rewards, turns."""
    path = run.dir / "rollouts.jsonl"
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()][-last:]
    out = ["<h2>Rollouts</h2>", f"<p>the last {len(lines)} of {html.escape(str(path))}</p>"]
    for ln in lines:
        e = json.loads(ln)
        terms = ", ".join(
            f"{k} {v:.3g}" for k, v in e.get("rewards", {}).items() if isinstance(v, (int, float))
        )
        head = f"step {e.get('step')}, prompt {e.get('prompt_index')} sample {e.get('sample')}: reward {e.get('reward', 0):.3g}"
        if e.get("turns", 1) > 1 or e.get("tool_calls"):
            head += f", {e.get('turns')} turns, {len(e.get('tool_calls', []))} tool calls"
        turns = "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in e.get("messages", []))
        out.append(
            f"<h3>{html.escape(head)}</h3><p>{html.escape(terms)}</p><pre>{html.escape(turns, quote=False)}</pre>"
        )
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(runs: list[Run]) -> list[tuple[str, list]]:
    """(dotted key, each run's value) for the config keys whose values differ (output_dir aside)."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat) - {"output_dir"})
    return [
        (k, [f.get(k, "(unset)") for f in flat])
        for k in keys
        if len({json.dumps(f.get(k), default=str) for f in flat}) > 1
    ]


def compare(run_dirs: list[str], output: str | Path | None = None) -> tuple[str, Path]:
    """(the terminal text, the HTML page's path)."""
    if len(run_dirs) < 2:
        raise ConfigError("ladle compare needs two run directories or more")
    runs = [Run(d) for d in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        names = [str(r.dir) for r in runs]
    diff = differences(runs)
    sums = [r.summary() for r in runs]
    metrics = [k for k in dict.fromkeys(k for s in sums for k in s)]
    lines = ["config keys that differ:" if diff else "the configs are the same (output_dir aside)"]
    width = max([len(k) for k, _ in diff] + [6])
    for k, vals in diff:
        lines.append(f"  {k:<{width}}  " + "  ".join(f"{str(v):<14}" for v in vals))
    lines.append("")
    lines.append(f"  {'':<{width}}  " + "  ".join(f"{n[:14]:<14}" for n in names))
    for m in metrics:
        cells = [s.get(m, "") for s in sums]
        lines.append(
            f"  {m:<{width}}  "
            + "  ".join(f"{(f'{v:.4g}' if isinstance(v, float) else str(v)):<14}" for v in cells)
        )
    out = Path(output) if output else runs[0].dir / "compare"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    fig, ax = _figure(plt, "loss", "loss")
    for r, n in zip(runs, names, strict=True):
        x, y = r.series("loss")
        (handle,) = ax.plot(x, y, label=f"{n} train")
        vx, vy = r.series("val_loss")
        if vx:
            ax.plot(vx, vy, ls="--", marker="o", ms=3, color=handle.get_color(), label=f"{n} val")
    loss_png = _save(plt, fig, ax, out / "loss.png")
    body = [
        "<h2>Config keys that differ</h2>",
        _table([[k, *vals] for k, vals in diff], ["key", *names])
        if diff
        else "<p>none (output_dir aside)</p>",
        "<h2>Summary</h2>",
        _table([[m, *[s.get(m, "") for s in sums]] for m in metrics], ["", *names]),
        "<h2>Loss</h2>",
        _img(loss_png),
    ]
    index = out / "index.html"
    index.write_text(page("ladle compare: " + ", ".join(names), "\n".join(body)))
    return "\n".join(lines), index
