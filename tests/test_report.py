"""`ladle report` and `ladle compare`: plots that hold data, pages that parse, and a real browser
(headless Chromium, which .ci/run installs) that renders them without console errors."""

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from ladle.cli import main

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
)


class Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"])


def parse(page: Path) -> Images:
    p = Images()
    p.feed(page.read_text())
    p.close()
    assert p.tags[:1] == ["html"] and "table" in p.tags
    return p


def not_blank(png: Path) -> bool:
    from matplotlib.image import imread

    img = imread(png)
    return png.stat().st_size > 1000 and float(img[..., :3].std()) > 0.01


@pytest.fixture(scope="module")
def two_runs(tokenizer_dir, data_dir, tmp_path_factory):
    from conftest import make_tiny_config

    runs = []
    for name, lr in (("a", 3e-3), ("b", 1e-3)):
        tmp = tmp_path_factory.mktemp(f"run_{name}")
        cfg = make_tiny_config(tokenizer_dir, data_dir, tmp / "run")
        cfg["optim"]["lr"] = lr
        cfg["train"].update(max_steps=8, eval_every=4)
        (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
        assert main(["run", "pretrain", "--config", str(tmp / "c.yaml")]) == 0
        runs.append(tmp / "run")
    return runs


def test_report_plots_every_series_and_inlines_them(two_runs, capsys):
    run = two_runs[0]
    assert main(["report", str(run)]) == 0
    out = run / "report"
    pngs = sorted(out.glob("*.png"))
    assert {p.stem for p in pngs} >= {"loss", "lr", "throughput", "mfu", "memory", "step_time"}
    assert all(not_blank(p) for p in pngs)
    page = parse(out / "index.html")
    assert len(page.images) == len(pngs) and all(s.startswith("data:image/png;base64,") for s in page.images)
    text = (out / "index.html").read_text()
    assert '"recipe": "pretrain"' in text and "optim:" in text  # the run card and the config


def test_report_plots_a_recipes_own_metrics(tmp_path):
    run = tmp_path / "rl"
    run.mkdir()
    (run / "config.yaml").write_text("output_dir: rl\n")
    recs = [{"step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s, "kl": 0.01 * s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["report", str(run)]) == 0
    assert (
        not_blank(run / "report" / "metric_reward_mean.png") and (run / "report" / "metric_kl.png").is_file()
    )


def test_compare_names_only_the_keys_that_differ(two_runs, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b), "--output", str(a.parent / "cmp")]) == 0
    text = capsys.readouterr().out
    diff = text.split("\n\n")[0]
    assert "optim.lr" in diff and "0.003" in diff and "0.001" in diff
    assert "output_dir" not in diff and "train.max_steps" not in diff  # the same in both
    assert "final val loss" in text and "tokens/s (median)" in text
    page = parse(a.parent / "cmp" / "index.html")
    assert len(page.images) == 1 and not_blank(a.parent / "cmp" / "loss.png")


@pytest.mark.parametrize("cmd", ["report", "compare"])
def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys, cmd, two_runs):
    args = [str(tmp_path)] if cmd == "report" else [str(two_runs[0]), str(tmp_path)]
    assert main([cmd, *args]) == 2
    assert (
        f"{tmp_path} is not a run directory: it needs the metrics.jsonl and config.yaml"
        in capsys.readouterr().err
    )


def browse(page: Path, shot: Path) -> tuple[str, str]:
    """(the DOM after load, the console lines) of `page` in headless Chromium; a screenshot to `shot`."""
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--log-level=0",
    ]
    flags.append("--virtual-time-budget=5000")  # run the page's load handlers before the dump
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1400,2400", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    console = [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln]
    return dom.stdout, "\n".join(console)


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("LADLE_CI"), reason="no Chromium here (.ci/run installs it)"
)
def test_the_pages_render_in_a_browser_without_console_errors(two_runs, tmp_path):
    assert CHROMIUM, "CI installs Debian's chromium (.ci/run); it is missing"
    a, b = two_runs
    assert main(["report", str(a)]) == 0 and main(["compare", str(a), str(b)]) == 0
    for page in (a / "report" / "index.html", a / "compare" / "index.html"):
        dom, console = browse(page, tmp_path / f"{page.parent.name}.png")
        n = len(parse(page).images)
        assert re.search(rf'<body data-plots="{n}/{n}"', dom), dom[:300]  # every plot decoded
        assert console == "", console
        assert not_blank(tmp_path / f"{page.parent.name}.png")
    bad = tmp_path / "bad.html"  # the check can fail: a page with an error is seen as one
    bad.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    _, console = browse(bad, tmp_path / "bad.png")
    assert "Uncaught ReferenceError" in console
