"""DPO's cached reference: the reference model's summed completion log-probs of every pair,
computed once before training and kept in the run directory (`reference/`), so that no reference
model stays in memory while the policy trains.

The cache is keyed by a hash of what determines it: the prepared data (its meta.json), the
reference weights (model.init_from's files, or the seed of the seeded init), the model shape,
the base's quantisation, the precision and data.seq_len. A resumed run reuses a cache whose key
matches; one made from other data or another reference is refused by name, never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ladle.config import LadleConfig
from ladle.errors import DataError

CACHE_DIR = "reference"


def identity(cfg: LadleConfig) -> dict:
    """What the cached log-probs depend on, in plain values (recorded beside the cache)."""
    init = cfg.model.init_from
    weights = None
    if init:
        root = Path(init).resolve()
        files = sorted(
            p
            for p in (root.rglob("*") if root.is_dir() else [root])
            if p.is_file() and "reference" not in p.parts
        )
        weights = [[str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    meta = Path(cfg.data.path) / "meta.json"
    model = cfg.model.model_dump(exclude={"init_from"})
    return {
        "data": str(Path(cfg.data.path).resolve()),
        "data_meta_sha256": hashlib.sha256(meta.read_bytes()).hexdigest(),
        "init_from": str(Path(init).resolve()) if init else None,
        "weights": weights,
        "seed": None if init else cfg.seed,
        "model": model,
        "quantize_base": cfg.lora.quantize_base if cfg.lora else "none",
        "precision": cfg.precision.mode,
        "seq_len": cfg.data.seq_len,
    }


def key_of(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def load(cfg: LadleConfig) -> dict[str, np.ndarray] | None:
    """The cached log-probs by split when the run directory holds a cache made for this config;
    None when there is none; a DataError when it was made from other data or another reference."""
    d = Path(cfg.output_dir) / CACHE_DIR
    if not (d / "key.json").is_file():
        return None
    try:
        saved = json.loads((d / "key.json").read_text())
        splits = {s: d / f"{s}.npy" for s in saved["splits"]}
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{d / 'key.json'} is damaged ({e}); delete {d} to compute the reference again"
        ) from None
    ident = identity(cfg)
    if saved.get("key") != key_of(ident):
        what = [k for k in ident if saved.get("identity", {}).get(k) != ident[k]]
        raise DataError(
            f"{d} holds reference log-probs computed from other inputs than this run's (differing: "
            f"{', '.join(what) or 'unknown'}); they are never reused. Restore the original data.path and "
            f"model.init_from, or delete {d} to compute them again (or use another output_dir)"
        )
    try:  # never pickles: a crafted file runs nothing
        return {s: np.load(f, allow_pickle=False) for s, f in splits.items()}
    except (OSError, ValueError) as e:
        raise DataError(
            f"{d}: a cached file is missing or damaged ({e}); delete {d} to compute it again"
        ) from None


def save(cfg: LadleConfig, logps: dict[str, np.ndarray]) -> None:
    """Writes the cache (rank 0), each file through a temporary name, key.json last."""
    d = Path(cfg.output_dir) / CACHE_DIR
    d.mkdir(parents=True, exist_ok=True)
    for split, a in logps.items():
        tmp = d / f".{split}.npy.tmp"
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, d / f"{split}.npy")
    ident = identity(cfg)
    tmp = d / ".key.json.tmp"
    tmp.write_text(json.dumps({"key": key_of(ident), "splits": list(logps), "identity": ident}, indent=1))
    os.replace(tmp, d / "key.json")


@torch.no_grad()
def compute(model, samples, par, micro_batch_size: int, device, context) -> np.ndarray:
    """(pairs, 2) summed completion log-probs of `model` over `samples` (PairSamples), each
    data-parallel rank taking every dp_size-th batch; ranks of a TP group compute the same rows.
    `context()` is the training forward's (autocast, loss-parallel)."""
    from ladle.data.loader import collate
    from ladle.preference.losses import pad_multiple, pair_logps

    n = len(samples)
    out = torch.zeros(n, 2, dtype=torch.float64, device=device)
    per_step = micro_batch_size * par.dp_size
    was_training = model.training
    model.eval()
    for start in range(0, n, per_step):  # every rank runs every step: FSDP's collectives match
        first = start + par.dp_rank * micro_batch_size
        idx = [min(i, n - 1) for i in range(first, first + micro_batch_size)]
        b = {k: v.to(device) for k, v in collate([samples.get(i) for i in idx]).items()}
        with context():
            lp, _ = pair_logps(model, b, pad_multiple(par.layout.tp), completions_only=par.layout.tp == 1)
        for j, i in enumerate(range(first, min(first + micro_batch_size, n))):
            out[i] = lp[j].double()
    model.train(was_training)
    par.all_reduce_loss(out)  # each row from the one dp rank that computed it
    return out.cpu().numpy().astype(np.float32)
