"""lm-evaluation-harness on ladle's model: `ladle eval --harness TASKS` and a training run's
`eval.harness` (docs/evaluation.md).

The tasks are the harness's own definitions: its registry, or a folder of the user's task YAMLs
(`--include-path`, `eval.harness_include_path`) whose data are local files, since the datasets
hub may be out of reach. They are checked before anything runs: an unknown name is refused with
the close matches, a task whose `dataset_kwargs.data_files` is missing with the file's name.
The model is ladle's (ladle/ops/harness_lm.py), scored as lm-eval's `hf` model scores the
exported folder. lm-eval is an extra: without it, asking for it exits 2 with the install line.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import random
import time
from pathlib import Path

import torch

from ladle import distributed as dist
from ladle import watchdog
from ladle.errors import ConfigError, DataError

INSTALL = "pip install 'ladle[eval]' (in a clone of ladle: make setup)"


def require_lm_eval(what: str) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs lm-evaluation-harness, which is not installed: {INSTALL}") from None


def task_manager(include_path: str | Path | None = None, *, field: str = "--include-path"):
    """lm-eval's TaskManager: its registry (a few seconds to index) and the user's folder."""
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"{field} {include_path} is not a folder of task YAMLs")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path) if include_path else None)


def checked_tasks(
    tasks: list[str],
    include_path,
    *,
    what: str,
    field: str = "--harness",
    include_field: str = "--include-path",
):
    """lm-eval's task index (its registry and `include_path`), once lm-eval is known to be there
    and every task in `tasks` is in the index with its local data files (what asks: `what`)."""
    require_lm_eval(what)
    manager = task_manager(include_path, field=include_field)
    check_tasks(tasks, manager, field=field, include_field=include_field)
    return manager


def check_tasks(
    tasks: list[str], manager, *, field: str = "--harness", include_field: str = "--include-path"
):
    """Every task is known to `manager` and its local data files exist (ConfigError / DataError)."""
    if not tasks:
        raise ConfigError(f"{field}: no task named")
    index = manager.task_index
    for name in tasks:
        if name not in index:
            raise ConfigError(unknown_task(name, manager, field, include_field))
    for name in tasks:
        for task, yaml_path, cfg in task_configs(name, index):
            check_data_files(task, yaml_path, cfg)


def unknown_task(name: str, manager, field: str, include_field: str) -> str:
    known = manager.all_tasks
    close = difflib.get_close_matches(name, known, n=8, cutoff=0.6)
    theirs = sorted(  # the user's own tasks: those not under lm-eval's package folder
        k
        for k, e in manager.task_index.items()
        if e.yaml_path is not None and "lm_eval" not in e.yaml_path.parts
    )
    text = f"{field}: unknown lm-evaluation-harness task {name!r}"
    text += f"; close matches: {', '.join(close)}" if close else ""
    if theirs:
        text += f"; the tasks of {include_field}: {', '.join(theirs[:20])}" + (
            " ..." if len(theirs) > 20 else ""
        )
    return text + f"; {len(known)} tasks, groups and tags are known (`lm-eval ls tasks` lists them)"


def task_configs(name: str, index: dict, depth: int = 0):
    """(task, YAML path, raw config) of each task a name stands for: itself, a group's members,
    a tag's tasks."""
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None or depth > 8:
        return
    if entry.kind == Kind.TAG:
        for k, e in index.items():
            if name in e.tags and e.cfg is not None:
                yield k, e.yaml_path, e.cfg
    elif entry.kind == Kind.GROUP:
        members = (entry.cfg or {}).get("task", [])
        for m in members if isinstance(members, list) else [members]:
            if isinstance(m, str):
                yield from task_configs(m, index, depth + 1)
            elif isinstance(m, dict):  # an inline task
                yield m.get("task", name), entry.yaml_path, m
    elif entry.cfg is not None:
        yield name, entry.yaml_path, entry.cfg


def check_data_files(task: str, yaml_path, cfg: dict) -> None:
    """The local files a task reads (`dataset_kwargs.data_files`: a path, a list, or split -> path
    or list) exist; relative paths are read from the working directory, as `datasets` reads them."""
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return
    values = files.values() if isinstance(files, dict) else [files]
    for v in values:
        for f in [v] if isinstance(v, str) else list(v):
            if any(c in f for c in "*?[") or "://" in f:
                continue  # a pattern or a URL: the harness's to resolve
            if not Path(f).exists():
                raise DataError(
                    f"task {task} ({yaml_path}): its data file {f} does not exist"
                    + ("" if Path(f).is_absolute() else f" (relative paths are read from {Path.cwd()})")
                )


def ladle_lm(model, tokenizer, *, batch_size: int = 8, **kw):
    """lm-eval's model over a loaded ladle model and its tokenizer (ladle/ops/harness_lm.py)."""
    if tokenizer is None:
        raise ConfigError("the harness needs the model's tokenizer; pass --tokenizer")
    from ladle.ops.harness_lm import LadleLM

    return LadleLM(model, tokenizer, batch_size=batch_size, **kw)


def run_harness(
    lm,
    tasks: list[str],
    manager,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    output_path: str | Path | None = None,
    log_samples: bool = False,
    name: str = "ladle",
) -> dict:
    """lm-eval's `simple_evaluate` output (results, configs, n-samples, ...; "samples" when
    `log_samples` or `output_path`); with `output_path`, the harness's own output folder
    (results_*.json, and samples_*.jsonl per task) written there, as its CLI writes it."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(output_path)) if output_path else None
    out = simple_evaluate(
        model=lm,
        model_args={"pretrained": name},  # the output folder's model name, as `hf`'s
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=lm.batch_size_per_gpu,
        log_samples=log_samples or tracker is not None,
        evaluation_tracker=tracker,
        task_manager=manager,
    )
    if tracker is not None:
        samples = out.get("samples") or {}
        tracker.save_results_aggregated(
            results={k: v for k, v in out.items() if k != "samples"}, samples=samples
        )
        for task in out.get("configs", {}):
            if task in samples:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    return out


def metric_records(results: dict) -> dict[str, float]:
    """{"harness/<task>/<metric>": value} of the harness's numeric metrics, without their stderr;
    the default filter's ",none" is dropped (acc,none -> acc), another filter kept (exact_match,flexible)."""
    out = {}
    for task, metrics in results.items():
        for key, v in metrics.items():
            if (
                "_stderr" in key
                or key == "sample_len"
                or isinstance(v, bool)
                or not isinstance(v, (int, float))
            ):
                continue
            out[f"harness/{task}/{key.removesuffix(',none')}"] = float(v)
    return out


@contextlib.contextmanager
def kept_rng(device: torch.device):
    """The random states as they were: the harness seeds Python's, NumPy's and torch's, which a
    training run's own draws must not feel."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type in ("cuda",) else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class TrainingHarness:
    """`eval.harness` in a training run: `__call__(model, step)` on every rank with the gathered
    model (None off rank 0); rank 0 scores the tasks while the others wait on the job's store,
    the watchdog seeing rank 0's progress (each batch is a new phase) and the waiting ranks in a
    collective, so a hang names rank 0; returns the metric records on rank 0, else None."""

    def __init__(self, cfg, tokenizer, device: torch.device, manager=None):
        self.cfg, self.tok, self.device = cfg, tokenizer, device
        # lm-eval's task index: the pre-launch check's, else built on rank 0 at the first evaluation
        self.manager = manager
        self.calls = 0  # in the store's key: a rollback replays a step, whose key is then taken

    def __call__(self, model, step: int) -> dict | None:
        self.calls += 1  # every rank calls at the same points, so the counts agree
        key = f"ladle/harness/{self.calls}/step_{step}"
        if dist.rank() != 0:
            wait_for(key)
            return None
        store = dist.store() if dist.world_size() > 1 else None

        def progress(n: int) -> None:
            watchdog.phase(f"harness: batch {n}")
            if store is not None:
                store.set(f"{key}/batches", str(n))

        try:
            return self.evaluate(model, progress)
        finally:
            if store is not None:
                store.set(key, "done")

    def evaluate(self, model, progress=None) -> dict:
        e = self.cfg
        t0 = time.perf_counter()
        logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines would flood the run's console
        if self.manager is None:
            self.manager = task_manager(e.harness_include_path, field="eval.harness_include_path")
        lm = ladle_lm(model, self.tok, batch_size=e.harness_batch_size)
        lm.on_batch = progress
        was_training = model.training
        try:
            with kept_rng(self.device):
                out = run_harness(
                    lm, e.harness, self.manager, limit=e.harness_limit, num_fewshot=e.harness_num_fewshot
                )
        finally:
            model.train(was_training)
        return {**metric_records(out["results"]), "harness_s": time.perf_counter() - t0}


def wait_for(key: str, poll_s: float = 0.5) -> None:
    """Wait (off rank 0) until rank 0 sets `key` in the job's store; each batch rank 0 finishes
    (`key/batches`) is progress here too, so only a stalled rank 0 trips the watchdog."""
    store, seen = dist.store(), None
    name = "collective: waiting for rank 0's harness evaluation"
    with watchdog.within(name):
        while not store.check([key]):
            if store.check([f"{key}/batches"]) and (n := store.get(f"{key}/batches")) != seen:
                seen = n
                watchdog.phase(name)
            time.sleep(poll_s)
