"""A run's loaders from a recipe's rows: each data-parallel rank's slice of every global batch (a
TP, CP or PP group reading once and broadcasting, `data.shared_read`), and the validation batches.
A data mixture's rows (ladle/data/mix.py) get its loader and its validation, source by source."""

from __future__ import annotations

import torch

from ladle.config import LadleConfig
from ladle.data.loader import BatchLayout, PretrainLoader, SharedLoader, eval_batch_count, eval_batches
from ladle.data.mix import MixedSamples, MixLoader, mix_eval_batches, mix_eval_count, stages
from ladle.parallel.mesh import Parallel


def train_loader(cfg: LadleConfig, rows, layout: BatchLayout, device) -> PretrainLoader:
    """The loader of `rows` for one rank: a data mixture's (MixLoader), or one folder's."""
    if isinstance(rows, MixedSamples):
        plan = stages(cfg.data.mix, cfg.data.mix_schedule)
        return MixLoader(rows, layout, plan, seed=cfg.seed, device=device, prefetch=cfg.data.prefetch)
    return PretrainLoader(rows, layout, seed=cfg.seed, device=device, prefetch=cfg.data.prefetch)


def make_loaders(cfg: LadleConfig, par: Parallel, samples, found, device, run):
    """(train rows, this rank's train loader, val rows, the validation batches or None)."""
    t = cfg.train
    # Each data-parallel rank reads its own slice of every global batch; a TP group shares one.
    layout = BatchLayout(t.micro_batch_size, t.grad_accum_steps, par.dp_rank, par.dp_size)
    train = samples(cfg, "train", found)
    mixed = isinstance(train, MixedSamples)
    loader = None
    if par.shared_rank == 0 or not cfg.data.shared_read:
        loader = train_loader(cfg, train, layout, device)
        if mixed:
            loader.note = run.events  # a resume's changed mixture, a source's new epoch
    if par.shared and cfg.data.shared_read:  # one read per TP/CP/PP group, broadcast to the rest
        loader = SharedLoader(
            loader,
            group=par.shared_group,
            leader=par.shared_leader,
            spec={
                k: ((t.micro_batch_size, *v.shape), torch.from_numpy(v).dtype)
                for k, v in train.get(0).items()
            },
            n_micro=t.grad_accum_steps,
            global_batch=layout.global_batch,
            device=device,
        )
        run.events(f"batches read by the first rank of each {par.shared} group and broadcast to the others")
    val = samples(cfg, "val", found)
    count, batches = (mix_eval_count, mix_eval_batches) if mixed else (eval_batch_count, eval_batches)
    n_eval = count(val, layout, t.eval_steps)
    evaluate = (lambda: batches(val, layout, t.eval_steps, device)) if n_eval else None
    if mixed and t.eval_steps and n_eval:  # a source too small for one batch has no val_loss/<name>
        short = [n for n, v in zip(val.names, val.sources, strict=True) if not eval_batch_count(v, layout, 1)]
        if short:
            run.events(
                f"no val_loss/<name> for data.mix source(s) {', '.join(short)}: their val split holds fewer "
                f"than one batch of {t.micro_batch_size * par.dp_size} samples; prepare them with a "
                "larger --val-fraction",
                level="warning",
            )
    if t.eval_steps and not n_eval:
        run.events(
            f"no validation: the val split has {len(val)} samples, fewer than one batch of "
            f"{t.micro_batch_size * par.dp_size}; prepare with --val-fraction to hold some out",
            level="warning",
        )
    return train, loader, val, evaluate
