"""`ladle eval`: loss and perplexity of a model (training checkpoint or Hugging Face folder) on a
split of prepared data.

The split is cut into samples of `seq_len` exactly as training reads it, in stream order, and
the loss is the sum of the token cross-entropies over the number of target tokens (fp32, like
validation during training). With `doc_mask` (the default, as in training) tokens attend only
within their document and RoPE positions restart per document; without it each row is plain
causal attention over its `seq_len` tokens, which is what `transformers` computes for the same
rows (tested).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ladle.data.folder import load_meta
from ladle.data.loader import PackedSamples, collate
from ladle.data.prepare import open_split
from ladle.errors import DataError
from ladle.train.loss import IGNORE_INDEX, cross_entropy_sum


def check_data_fits(data: str | Path, tok, vocab_size: int) -> None:
    """The data was tokenized by this model's tokenizer and its ids fit the embedding."""
    if not (Path(data) / "meta.json").is_file():
        return  # Megatron folders carry no tokenizer record
    meta = load_meta(data)
    theirs = meta.get("tokenizer_hash")
    if tok is not None and theirs and theirs != tok.hash:
        raise DataError(
            f"{data} was prepared with a different tokenizer ({meta.get('tokenizer_path')}, sha256 "
            f"{theirs[:12]}) than the model's ({tok.path}, sha256 {tok.hash[:12]}); pass --tokenizer, "
            "or prepare the data with the model's tokenizer"
        )
    if int(meta.get("vocab_size", 0)) > vocab_size:
        raise DataError(
            f"{data} holds token ids up to {meta['vocab_size'] - 1}, beyond the model's {vocab_size} "
            "embedding rows: the data was prepared for another model"
        )


@torch.no_grad()
def evaluate(
    model,
    data: str | Path,
    *,
    split: str = "val",
    seq_len: int = 512,
    batch_size: int = 8,
    max_batches: int = 0,
    doc_mask: bool = True,
    device: torch.device | str = "cpu",
) -> dict:
    """{"loss", "ppl", "tokens", "samples", ...} over the first max_batches batches (0: all)."""
    if seq_len > model.cfg.max_seq_len:
        raise DataError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    samples = PackedSamples(open_split(data, split), seq_len, name=split)
    n = len(samples)
    if n == 0:
        raise DataError(
            f"the {split} split of {data} has fewer than seq_len + 1 = {seq_len + 1} tokens; "
            "pick another --split or a smaller --seq-len"
        )
    batches = -(-n // batch_size)
    if max_batches:
        batches = min(batches, max_batches)
    t0 = time.perf_counter()
    model.eval()
    loss_sum, count, used = 0.0, 0, 0
    for b in range(batches):
        idx = range(b * batch_size, min((b + 1) * batch_size, n))
        batch = {k: v.to(device) for k, v in collate([samples.get(i) for i in idx]).items()}
        if doc_mask:
            logits = model(batch["tokens"], positions=batch["positions"], doc_ids=batch["doc_ids"])
        else:
            logits = model(batch["tokens"])
        loss_sum += float(cross_entropy_sum(logits, batch["targets"]).double())
        count += int((batch["targets"] != IGNORE_INDEX).sum())
        used += len(idx)
    loss = loss_sum / max(count, 1)
    return {
        "split": split,
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "tokens": count,
        "samples": used,
        "seq_len": seq_len,
        "doc_mask": doc_mask,
        "eval_s": round(time.perf_counter() - t0, 3),
    }


@torch.no_grad()
def evaluate_pairs(
    model, data_dir, *, split: str = "val", batch_size: int = 8, pad_id: int = 0, device="cpu"
) -> dict:
    """Held-out preference accuracy of prepared preference pairs: for a reward model (`head:
    score`) the share of pairs whose chosen side scores higher; for a causal LM the share whose
    chosen completion has the higher summed log-prob. Also the mean margin (score, or log-prob)."""
    from ladle.data.loader import collate
    from ladle.data.pairs import PairSamples
    from ladle.data.preference import PreferenceSplit
    from ladle.preference.losses import pair_logps, pair_scores

    pairs = PreferenceSplit(data_dir, split)
    if len(pairs) == 0:
        raise DataError(f"{data_dir}: the {split} split holds no pairs (prepare with --val-fraction)")
    rows = PairSamples(pairs, int(pairs.lengths.max()), pad_id=pad_id, name=split)
    score = model.cfg.head == "score"
    wins, margin = 0, 0.0
    for s in range(0, len(rows), batch_size):
        b = collate([rows.get(i) for i in range(s, min(s + batch_size, len(rows)))])
        b = {k: v.to(device) for k, v in b.items()}
        v = pair_scores(model, b) if score else pair_logps(model, b)[0]
        d = (v[:, 0] - v[:, 1]).float()
        wins += int((d > 0).sum())
        margin += float(d.sum())
    kind = "reward model score" if score else "summed completion log-prob"
    return {
        "data": str(data_dir),
        "split": split,
        "pairs": len(rows),
        "accuracy": wins / len(rows),
        "margin": margin / len(rows),
        "compared": kind,
    }
