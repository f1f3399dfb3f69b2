"""What every recipe shares: check, build, train, report. A recipe is a `Recipe` object: its rows
(`samples(cfg, split, found)`), and where it needs them its loss and other models (`setup`), the
checks of what it cannot run on, and the model a rank of a separated placement trains. `run`
gives it the checks, the resume decision, the layout, the policy built and laid out, the
loaders, the loop, the end-of-run sample and the run card. See ladle/recipes/pretrain.py and
sft.py for the shortest recipes on it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ladle import device as dev
from ladle import distributed as dist
from ladle.checkpoint.resume import Resume, worker_resume
from ladle.config import LadleConfig
from ladle.data.folder import data_identity
from ladle.launch.checks import Checked, check
from ladle.models.llama import count_params
from ladle.parallel.compile import eager
from ladle.parallel.mesh import Layout, Parallel
from ladle.parallel.parallelize import gather_model
from ladle.plan import oom_report
from ladle.train.builder import build_laid_out
from ladle.train.loaders import make_loaders
from ladle.train.loop import Trainer
from ladle.train.loss import CausalLMLoss, Loss
from ladle.train.metrics import model_flops
from ladle.train.precision import resolve_mode
from ladle.train.run import RunDir, sample_text, throughput_summary
from ladle.train.unit import TrainUnit


@dataclass
class Training:
    """What a recipe's `setup` hands back: its rows, its loss, and optionally `wrap(loader,
    evaluate) -> (loader, evaluate)` (the RL recipes' rollouts made from each step's prompts) and
    `trainer`, the loop's class or a factory with its signature (a step of more than one unit)."""

    samples: object  # (cfg, split, found) -> rows with len() and get(i)
    loss: Loss
    wrap: object = None
    trainer: object = None


@dataclass
class Setup:
    """What a recipe's `setup` sees once its policy is built."""

    cfg: LadleConfig
    par: Parallel
    device: torch.device
    unit: TrainUnit  # the policy's (on a separated placement's other group: what that group trains)
    run: RunDir
    found: Checked
    resume: Resume


class Recipe:
    """A training method on the shared loop. A recipe says what differs: its rows (`samples`), its
    loss and the other models it needs once the policy is built (`setup`), the data it trains on
    (`data_task`), what it cannot run on (`check_layout`), the models it reads besides the policy
    (`check_paths`), and in a separated placement the groups of ranks (`placement`) and what each
    trains (`unit_config`). `run(cfg)` trains it."""

    name = ""
    data_task = "pretrain"  # the `ladle data prepare --task` its data comes from (meta.json's task)
    mixes = False  # it reads a weighted mixture of folders (data.mix) in place of data.path
    rollouts = False  # its batches are generated each step (the RL recipes), not read by a loader

    def samples(self, cfg: LadleConfig, split: str, found: Checked):
        """Rows with len() and get(i) of the prepared data's `split`."""
        raise NotImplementedError

    def setup(self, s: Setup) -> Training:
        """Its rows and loss (None: the causal-LM loss), once the policy is built."""
        return Training(self.samples, None)

    def config(self, cfg: LadleConfig) -> LadleConfig:
        """The run config as this recipe trains it (a reward model's score head)."""
        return cfg

    def check_layout(self, cfg: LadleConfig, layout: Layout) -> None:
        """Refuses what this recipe cannot run on (ConfigError)."""

    def check_paths(self, cfg: LadleConfig) -> None:
        """Checks the other models it reads, before launch (where the files are)."""

    def placement(self, cfg: LadleConfig) -> tuple[int, str] | None:
        """(groups of ranks, what they hold) of a separated placement; None: every model on every rank."""
        return None

    def unit_config(self, cfg: LadleConfig, par: Parallel) -> LadleConfig:
        """The config of the model this rank trains (a separated placement's other group: the critic)."""
        return cfg

    def builds_model(self, cfg: LadleConfig, par: Parallel) -> bool:
        """Whether this rank holds a model of ladle's (not a separated vLLM engine rank: vLLM's)."""
        return True

    def run(self, cfg: LadleConfig, loss: Loss | None = None) -> str:
        """Trains (with `loss`, another objective on the same rows) and writes the run card;
        returns the loop's status."""
        return run(self.config(cfg), self, loss)


def build_trainer(
    recipe: Recipe,
    cfg: LadleConfig,
    device: torch.device,
    found: Checked,
    resume: Resume | None,
    par: Parallel | None = None,
    loss: Loss | None = None,  # the recipe's (`setup`), else the causal-LM loss
) -> Trainer:
    par = par or Parallel(Layout(), device)
    resume = resume or Resume(None)
    run = RunDir(cfg, device, recipe=recipe.name, resume=resume)
    # the policy, or what this rank's group trains in a separated placement (PPO's critic)
    unit_cfg = recipe.unit_config(cfg, par)
    if recipe.builds_model(cfg, par):
        built = build_laid_out(unit_cfg, par, device, load=resume.path is None)
        for note in built.notes:
            run.events(note)
        if built.source:
            run.events(f"weights from {built.source}")
        model, pipeline = built.model, built.pipeline
    else:  # its model is another program's (a separated vLLM engine rank's): a placeholder unit
        model, pipeline = torch.nn.Linear(1, 1, device=device), None
    n_params = count_params(cfg.model)
    n_no_embed = count_params(cfg.model, exclude_embeddings=True, active=True)
    fpt, trained = model_flops(cfg, n_no_embed)
    unit = TrainUnit(unit_cfg, model, device, par, pipeline)
    training = recipe.setup(Setup(cfg, par, device, unit, run, found, resume))
    train, loader, val, evaluate = make_loaders(cfg, par, training.samples, found, device, run)
    if training.wrap is not None:  # e.g. the RL recipes' rollouts from each step's prompts
        loader, evaluate = training.wrap(loader, evaluate)
    loss = training.loss or loss or CausalLMLoss(cfg.model.moe)
    trainer = (training.trainer or Trainer)(
        cfg,
        run,
        unit,
        loader,
        loss,
        flops_per_token=fpt,
        eval_batches=evaluate,
        identity=data_identity(cfg, found["tokenizer"]),  # the tokenizer check loaded, not again
        oom_report=functools.partial(oom_report, cfg, recipe.name, par.layout, device),
        harness=harness_hook(cfg, par, device, found) if cfg.eval.harness else None,
    )
    run.events(
        f"model: {n_params:,} parameters (N = {n_no_embed:,} for MFU: all but the input embedding"
        f"{', experts a token uses' if cfg.model.moe else ''}){trained}; "
        f"{len(train):,} train samples of {cfg.data.seq_len} tokens, {len(val):,} validation samples; "
        f"device {device} ({dev.device_name(device)}), world size {dist.world_size()}, "
        f"layout {par.layout.describe()}"
    )
    run.write_card(
        status="running",
        parameters=n_params,
        parameters_without_embedding=n_no_embed,
        flops_per_token=fpt,
        mfu_peak_tflops=trainer.peak_tflops,
        mfu_peak_source=trainer.peak_source,
        tokenizer_hash=found["tokenizer"].hash,
        data={
            "path": cfg.data.path,
            **({"mix": [m.model_dump() for m in cfg.data.mix]} if cfg.data.mix else {}),
            "train_samples": len(train),
            "val_samples": len(val),
        },
    )
    if resume.path is not None:
        trainer.resume_from(resume.path)
    return trainer


def harness_hook(cfg: LadleConfig, par: Parallel, device: torch.device, found: Checked):
    """eval.harness's (model, step) -> records: the weights gathered whole onto rank 0 (every
    rank takes part), scored there while the others wait (ladle/ops/harness.py)."""
    from ladle.ops.harness import TrainingHarness

    harness = TrainingHarness(cfg.eval, found["tokenizer"], device, found.harness_tasks)  # the check's index

    def run_at(model, step: int) -> dict | None:
        plain = gather_model(model, par, cfg.model, cfg.lora)
        with eager():
            return harness(plain, step)

    return run_at


def run(cfg: LadleConfig, recipe: Recipe, loss: Loss | None = None) -> str:
    """Checks, trains and writes the run card of `recipe` on this process (one of torchrun's, or
    alone); returns the loop's status."""
    found = check(cfg, recipe)  # init_from, tokenizer and data, before anything is written
    cfg = found.cfg
    device = dev.pick_device(cfg.train.device, dist.local_rank())
    dev.apply_alloc_conf(device.type, cfg.device.alloc_conf)  # before the first allocation
    dev.set_device(device)
    dist.init(device, cfg.dist.timeout_s, trace_dir=str(Path(cfg.output_dir) / "hang"))
    try:
        status = _train(cfg, recipe, found, device, loss)
        # Every rank waits for rank 0's sample and run card, then all leave the process group
        # together: a rank whose process exits with its group alive can abort in gloo's threads
        # ("terminate called without an active exception") while rank 0 still works, and torchrun
        # then reports the finished run as failed.
        dist.barrier()
    finally:
        dist.shutdown()
    return status


def _train(cfg: LadleConfig, recipe: Recipe, found: Checked, device: torch.device, loss=None) -> str:
    cfg, precision_note = resolve_mode(cfg, device)  # config.yaml records the mode that ran
    resume = worker_resume(cfg, device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    layout = check(cfg, recipe, world=dist.world_size(), paths=False).layout
    par = Parallel(layout, device, cfg.parallel.cp_attention)
    trainer = build_trainer(recipe, cfg, device, found, resume, par, loss)
    run_dir = trainer.run
    if precision_note:
        run_dir.events(precision_note, level="warning" if "emulates" in precision_note else "info")
    try:
        status = trainer.fit()
    finally:  # TensorBoard's and W&B's files whole, also after an error
        run_dir.metrics.close()
    final = {"status": status, "step": trainer.step, "tokens_seen": trainer.tokens_seen}
    if trainer.last_record:
        final["train_loss"] = trainer.last_record["loss"]
    final.update(trainer.recipe_metrics)
    if trainer.last_val:
        final.update({k: v for k, v in trainer.last_val.items() if k.startswith("val_")})
    # a reward model scores, it does not generate; a separated placement's policy is on role 0
    writes = cfg.model.head == "lm" and par.role == 0
    if status == "completed" and writes and cfg.sample.prompt and cfg.sample.max_new_tokens:
        model = gather_model(trainer.model, par, cfg.model, cfg.lora)  # every rank takes part; rank 0 gets it
        text = None
        if model is not None:
            with eager():
                text = sample_text(cfg, model, found["tokenizer"], device)
        if text is not None:
            final["sample"] = text
            run_dir.console.rule("sample")
            run_dir.console.print(text, markup=False, highlight=False)
            run_dir.console.rule()
    run_dir.write_card(
        status=status,
        final=final,
        throughput=throughput_summary(run_dir.dir),
        ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    run_dir.events(f"run {status} at step {trainer.step}; results in {run_dir.dir}")
    return status
