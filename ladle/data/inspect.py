"""`ladle data inspect`: what is in a prepared data folder, at a glance (or a config's data mixture:
each source's tokens, effective share and epochs); `ladle data show`: the records a report named
(a bad step's samples), decoded whole.

Per split: documents, tokens, shards, and a histogram of document lengths in log2 buckets. For the train
split: the unigram entropy of its tokens in nats per token (how much a model that ignores context
would pay; a sanity check that the data is not degenerate), and decoded samples when a tokenizer is at
hand; for preference data, the pairs per split and decoded pairs (prompt, chosen, rejected); for
prompts (the RL recipes'), the prompts per split, decoded, with their records' other fields.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ladle.data.folder import SPLITS, load_meta
from ladle.data.prepare import TokenStream, open_split
from ladle.data.tokenizer import Tokenizer, load_tokenizer
from ladle.errors import DataError

ENTROPY_CHUNK = 1 << 24  # tokens per np.bincount call: bounded memory on any split size
SAMPLE_CHARS = 200


def inspect_data(
    data_dir: str | os.PathLike, *, samples: int = 2, tokenizer: str | os.PathLike | Tokenizer | None = None
) -> dict:
    """A report dict on the data folder (see `format_inspect`). `tokenizer` defaults to the one named
    in meta.json, when it still exists; without one there are no samples."""
    path = Path(data_dir)
    meta = load_meta(path) if (path / "meta.json").is_file() else None
    report: dict = {"path": str(path), "meta": meta, "splits": {}, "notes": [], "samples": []}
    streams = {}
    for split in SPLITS:
        stream = open_split(path, split)
        if not stream.num_documents:
            continue
        streams[split] = stream
        report["splits"][split] = {
            "documents": stream.num_documents,
            "tokens": stream.num_tokens,
            "shards": len(stream.prefixes),
            "mean_length": stream.num_tokens / max(stream.num_documents, 1),
            "length_histogram": length_histogram(stream.doc_lengths),
        }
    train = streams.get("train")
    if train is None:  # a tiny corpus can land entirely in val
        report["unigram_entropy_nats"], report["distinct_tokens"] = 0.0, 0
        report["notes"].append("the train split is empty")
        return report
    vocab = meta["vocab_size"] if meta else None
    report["unigram_entropy_nats"], report["distinct_tokens"] = unigram_entropy(train, vocab)

    tok = _pick_tokenizer(tokenizer, meta, report["notes"])
    if meta and meta.get("task") == "preference":
        report["pairs"] = {name: meta["splits"][name]["pairs"] for name in report["splits"]}
        if tok is not None:
            report["samples"] = pair_samples(path, tok, samples)
        return report
    if meta and meta.get("task") == "prompts":
        report["prompts"] = {name: meta["splits"][name]["prompts"] for name in report["splits"]}
        if tok is not None:
            report["samples"] = prompt_samples(path, tok, samples)
        return report
    if tok is not None:
        for i in range(min(samples, train.num_documents)):
            start, length = int(train.doc_starts[i]), int(train.doc_lengths[i])
            # Decode a prefix only: enough tokens for SAMPLE_CHARS characters in any sane tokenizer.
            ids = train.read(start, start + min(length, SAMPLE_CHARS))
            report["samples"].append(
                {"document": i, "tokens": length, "text": tok.decode(ids)[:SAMPLE_CHARS]}
            )
    return report


def pair_samples(path: Path, tok: Tokenizer, n: int) -> list[dict]:
    """The first `n` train pairs decoded: the prompt (the untrained tokens before the completion)
    and each side's completion (its trained tokens)."""
    from ladle.data.preference import PreferenceSplit

    pairs = PreferenceSplit(path, "train")
    out = []
    for i in range(min(n, len(pairs))):
        c_ids, c_mask, r_ids, r_mask = pairs.get(i)
        start = int(np.argmax(c_mask))
        out.append(
            {
                "pair": i,
                "tokens": [len(c_ids), len(r_ids)],
                "prompt": tok.decode(c_ids[:start], False)[-SAMPLE_CHARS:],  # special tokens shown
                "chosen": tok.decode(c_ids[c_mask], False)[:SAMPLE_CHARS],
                "rejected": tok.decode(r_ids[r_mask], False)[:SAMPLE_CHARS],
            }
        )
    return out


def prompt_samples(path: Path, tok: Tokenizer, n: int) -> list[dict]:
    """The first `n` train prompts decoded (their ends: what the model answers) and the other
    fields of their records."""
    from ladle.data.prompts import PromptSplit

    prompts = PromptSplit(path, "train")
    out = []
    for i in range(min(n, len(prompts))):
        ids, record = prompts.get(i)
        fields = {k: v for k, v in record.items() if k != "prompt"}
        out.append(
            {
                "prompt_index": i,
                "tokens": len(ids),
                "text": tok.decode(ids, False)[-SAMPLE_CHARS:],  # special tokens shown
                "fields": json.dumps(fields, ensure_ascii=False)[:SAMPLE_CHARS],
            }
        )
    return out


def show_data(
    data_dir: str | os.PathLike,
    indices: list[int],
    *,
    split: str = "train",
    tokenizer: str | os.PathLike | Tokenizer | None = None,
) -> dict:
    """The records `indices` of a split, decoded whole: documents (pretraining data), chats (sft),
    pairs (preference) or prompts, as the folder's task holds them; a bad step's report names
    them so (ladle/train/loop.py). Without a tokenizer, the token ids."""
    from ladle.data.preference import PreferenceSplit
    from ladle.data.prompts import PromptSplit
    from ladle.data.sft import SFTSplit

    path = Path(data_dir)
    meta = load_meta(path) if (path / "meta.json").is_file() else None
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    notes: list[str] = []
    tok = _pick_tokenizer(tokenizer, meta, notes)
    task = (meta or {}).get("task", "pretrain")

    def text(ids, special=False):
        ids = np.asarray(ids)
        return tok.decode(ids, not special) if tok is not None else " ".join(map(str, ids.tolist()))

    if task == "preference":
        records, unit = PreferenceSplit(path, split), "pair"
    elif task == "prompts":
        records, unit = PromptSplit(path, split), "prompt"
    elif task == "sft":
        records, unit = SFTSplit(path, split), "chat"
    else:
        records, unit = open_split(path, split), "document"
    count = records.num_documents if unit == "document" else len(records)
    out = []
    for i in indices:
        if not 0 <= i < count:
            raise DataError(
                f"{path}: no {unit} {i} in the {split} split, which holds {count} (0 to {count - 1})"
            )
        rec: dict = {unit: i}
        if unit == "document":
            start = int(records.doc_starts[i])
            ids = records.read(start, start + int(records.doc_lengths[i]))
            rec.update(tokens=len(ids), text=text(ids))
        elif unit == "chat":
            ids, mask = records.get(i)
            rec.update(
                tokens=len(ids),
                trained=int(mask.sum()),
                text=text(ids, True),
                trained_text=text(ids[mask], True),
            )
        elif unit == "pair":
            c_ids, c_mask, r_ids, r_mask = records.get(i)
            start = int(np.argmax(c_mask))
            rec.update(
                tokens=[len(c_ids), len(r_ids)],
                prompt=text(c_ids[:start], True),
                chosen=text(c_ids[c_mask], True),
                rejected=text(r_ids[r_mask], True),
            )
        else:
            ids, record = records.get(i)
            rec.update(
                tokens=len(ids),
                text=text(ids, True),
                fields={k: v for k, v in record.items() if k != "prompt"},
            )
        out.append(rec)
    return {"path": str(path), "split": split, "task": task, "records": out, "notes": notes}


def format_show(report: dict) -> str:
    lines = [f"data folder {report['path']}, {report['split']} split ({report['task']})"]
    for rec in report["records"]:
        unit = next(iter(rec))
        head = f"{unit} {rec[unit]}"
        if unit == "pair":
            c, r = rec["tokens"]
            lines += [
                f"== {head} ({c:,} / {r:,} tokens)",
                f"-- prompt:\n{rec['prompt']}",
                f"-- chosen:\n{rec['chosen']}",
                f"-- rejected:\n{rec['rejected']}",
            ]
            continue
        lines.append(
            f"== {head} ({rec['tokens']:,} tokens"
            + (f", {rec['trained']:,} trained)" if unit == "chat" else ")")
        )
        lines.append(rec["text"])
        if unit == "chat":
            lines += ["-- trained tokens:", rec["trained_text"]]
        if unit == "prompt":
            lines.append(f"-- fields: {json.dumps(rec['fields'], ensure_ascii=False)}")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)


def length_histogram(lengths: np.ndarray) -> list[dict]:
    """Document counts in buckets [2**k, 2**(k+1)), from the shortest to the longest document."""
    if lengths.size == 0:
        return []
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(buckets)
    low = int(buckets.min())
    return [
        {"min": 2**k, "max": 2 ** (k + 1) - 1, "documents": int(counts[k])} for k in range(low, counts.size)
    ]


def unigram_entropy(stream: TokenStream, vocab_size: int | None = None) -> tuple[float, int]:
    """Entropy (nats per token) of the token frequencies of `stream`, and how many distinct ids occur."""
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for start in range(0, stream.num_tokens, ENTROPY_CHUNK):
        chunk = np.bincount(stream.read(start, min(start + ENTROPY_CHUNK, stream.num_tokens)))
        if chunk.size > counts.size:  # no vocab_size known (Megatron data), or an id beyond it
            counts = np.pad(counts, (0, chunk.size - counts.size))
        counts[: chunk.size] += chunk
    total = counts.sum()
    if total == 0:
        return 0.0, 0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum()), int(p.size)


def _pick_tokenizer(tokenizer, meta: dict | None, notes: list[str]) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    elif tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif meta and (Path(meta["tokenizer_path"]) / "tokenizer.json").is_file():
        tok = load_tokenizer(meta["tokenizer_path"])
    else:
        if meta:
            notes.append(f"tokenizer {meta['tokenizer_path']} not found: no decoded samples")
        return None
    if meta and tok.hash != meta["tokenizer_hash"]:
        notes.append(f"tokenizer {tok.path} is not the one this data was prepared with (hash differs)")
    return tok


def inspect_mix(cfg, global_batch: int) -> dict:
    """A data mixture (`data.mix`) as a run of `cfg` with `global_batch` samples a step would draw
    it: each source's tokens and samples, its weight in each stage of `data.mix_schedule`, the
    share of the run's samples it gets (the effective share) and the epochs it is read for by
    `train.max_steps`."""
    from ladle.data.mix import stages

    d, steps = cfg.data, cfg.train.max_steps
    plan = [(s, w) for s, w in stages(d.mix, d.mix_schedule) if s < steps]
    drawn = dict.fromkeys((m.name for m in d.mix), 0.0)
    for i, (start, w) in enumerate(plan):
        end = plan[i + 1][0] if i + 1 < len(plan) else steps
        total = sum(w.values())
        for name in drawn:
            drawn[name] += (end - start) * global_batch * w.get(name, 0.0) / total
    all_drawn = steps * global_batch
    sources, notes = [], []
    for m in d.mix:
        train, val = open_split(m.path, "train"), open_split(m.path, "val")
        n = max(0, (train.num_tokens - 1) // d.seq_len)
        epochs = drawn[m.name] / n if n else float("inf")
        sources.append(
            {
                "name": m.name,
                "path": m.path,
                "train_tokens": train.num_tokens,
                "val_tokens": val.num_tokens,
                "train_samples": n,
                "weights": [w.get(m.name, 0.0) for _, w in plan],
                "share": drawn[m.name] / all_drawn,
                "samples_drawn": round(drawn[m.name]),
                "epochs": epochs,
            }
        )
        if epochs > 4:  # repeats past ~4 epochs add little (Muennighoff et al. 2023)
            notes.append(f"source {m.name} is read {epochs:.1f} times by train.max_steps")
    return {
        "stages": [s for s, _ in plan],
        "max_steps": steps,
        "global_batch": global_batch,
        "seq_len": d.seq_len,
        "sources": sources,
        "notes": notes,
    }


def format_mix(report: dict) -> str:
    stages = report["stages"]
    lines = [
        f"data mix: {len(report['sources'])} sources, {report['max_steps']:,} steps of {report['global_batch']} "
        f"samples x {report['seq_len']} tokens"
        + (f"; weights change at steps {', '.join(map(str, stages[1:]))}" if len(stages) > 1 else "")
    ]
    head = [
        "source",
        "train tokens",
        "val tokens",
        "weight" + ("s" if len(stages) > 1 else ""),
        "share",
        "epochs",
    ]
    rows = [
        [
            s["name"],
            f"{s['train_tokens']:,}",
            f"{s['val_tokens']:,}",
            " -> ".join(f"{w:g}" for w in s["weights"]),
            f"{s['share']:.1%}",
            f"{s['epochs']:.2f}",
        ]
        for s in report["sources"]
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.extend(f"  note: {note}" for note in report["notes"])
    return "\n".join(lines)


def format_inspect(report: dict) -> str:
    """The report as console text."""
    meta = report["meta"]
    lines = [f"data folder {report['path']}"]
    if meta:
        lines.append(
            f"  tokenizer {meta['tokenizer_path']} (vocab {meta['vocab_size']:,}, eos {meta['eos_id']}), "
            f"dtype {meta['dtype']}, val_fraction {meta['val_fraction']}, seed {meta['seed']}"
        )
    else:
        lines.append("  Megatron indexed data without meta.json (read as a train split, no tokenizer check)")
    for name, split in report["splits"].items():
        lines.append(
            f"  {name}: {split['documents']:,} documents, {split['tokens']:,} tokens in {split['shards']} "
            f"shard(s), {split['mean_length']:,.1f} tokens per document"
        )
        width = max(d["documents"] for d in split["length_histogram"])
        for bucket in split["length_histogram"]:
            bar = "#" * round(30 * bucket["documents"] / width)
            lines.append(f"    {bucket['min']:>9,}-{bucket['max']:<9,} {bucket['documents']:>10,} {bar}")
    lines.append(
        f"  train unigram entropy: {report['unigram_entropy_nats']:.3f} nats/token "
        f"over {report['distinct_tokens']:,} distinct tokens"
    )
    if meta and meta["bad_records"]:
        lines.append(f"  bad records skipped at prepare: {sum(meta['bad_records'].values()):,}")
        for reason, count in meta["bad_records"].items():
            lines.append(f"    {reason}: {count:,} (e.g. {', '.join(meta['bad_examples'][reason][:2])})")
    if "pairs" in report:
        lines.append("  preference pairs: " + ", ".join(f"{k} {v:,}" for k, v in report["pairs"].items()))
    if "prompts" in report:
        lines.append("  prompts: " + ", ".join(f"{k} {v:,}" for k, v in report["prompts"].items()))
    for sample in report["samples"]:
        if "prompt_index" in sample:
            lines.append(
                f"  prompt {sample['prompt_index']} ({sample['tokens']:,} tokens): ...{sample['text']!r}"
            )
            lines.append(f"    fields: {sample['fields']}")
        elif "pair" in sample:
            c, r = sample["tokens"]
            lines.append(f"  pair {sample['pair']} ({c:,} / {r:,} tokens): prompt ...{sample['prompt']!r}")
            lines.append(f"    chosen:   {sample['chosen']!r}")
            lines.append(f"    rejected: {sample['rejected']!r}")
        else:
            lines.append(f"  document {sample['document']} ({sample['tokens']:,} tokens): {sample['text']!r}")
    lines.extend(f"  note: {note}" for note in report["notes"])
    return "\n".join(lines)
