"""Tokens/s of `ladle data prepare` against Hugging Face `datasets`, on the Python standard library.

Both sides read the same files, tokenize every document with the same `tokenizers` BPE (vocab 8192,
trained first on the same corpus), append EOS, and put the ids on disk: ladle writes its shards,
`datasets` its Arrow cache (`Dataset.from_generator` + `.map(batched=True, num_proc=workers)`). The
documents ladle counts as bad (empty or not UTF-8) are left out of the `datasets` side too, so both
tokenize the same text. Prints one JSON line; medians over --repeats runs.

    python bench/data_prepare.py --limit-mb 5 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from ladle.data.prepare import default_workers, prepare
from ladle.data.sources import iter_files
from ladle.data.tokenizer import train_tokenizer


def corpus(limit_mb: float | None) -> list[Path]:
    """The stdlib's *.py files in sorted order, without site-packages, up to limit_mb megabytes."""
    files, total = [], 0
    for path in iter_files([sysconfig.get_paths()["stdlib"]], "*.py", ["site-packages/*"]):
        size = path.stat().st_size
        if limit_mb is not None and files and total + size > limit_mb * 2**20:
            break
        files.append(path)
        total += size
    return files


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu, "cores": cores}


def run_ladle(files: list[Path], tok_dir: Path, out: Path, workers: int) -> tuple[float, int]:
    start = time.perf_counter()
    meta = prepare(
        [str(f) for f in files], tokenizer=str(tok_dir), output=str(out), workers=workers, progress=False
    )
    seconds = time.perf_counter() - start
    return seconds, sum(s["tokens"] for s in meta["splits"].values())


def _good_texts(files: list[str]):
    # The same documents ladle keeps: strict UTF-8, not blank.
    for name in files:
        try:
            text = Path(name).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            yield {"text": text}


def run_datasets(files: list[Path], tok_dir: Path, cache: Path, workers: int) -> tuple[float, int]:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="<|eos|>")
    eos = hf.eos_token_id

    def tokenize(batch):
        ids = hf(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    start = time.perf_counter()
    ds = Dataset.from_generator(
        _good_texts, gen_kwargs={"files": [str(f) for f in files]}, cache_dir=str(cache)
    )
    out = ds.map(
        tokenize,
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
        cache_file_name=str(cache / "tokenized.arrow"),
    )
    seconds = time.perf_counter() - start
    lengths = out.with_format("arrow")["input_ids"].combine_chunks().value_lengths()
    return seconds, int(lengths.to_numpy().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mb", type=float, default=None, help="cap the corpus at this many MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=default_workers())
    args = parser.parse_args()

    import datasets

    datasets.disable_progress_bars()
    files = corpus(args.limit_mb)
    corpus_mb = sum(f.stat().st_size for f in files) / 2**20
    with tempfile.TemporaryDirectory(prefix="ladle-bench-") as tmp:
        tmp = Path(tmp)
        tok_dir = train_tokenizer([str(f) for f in files], vocab_size=8192, output=str(tmp / "tok"))
        if args.workers > 1:
            # One single-threaded tokenizer per process on both sides, as many processes as workers.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        ladle_runs, datasets_runs, tokens = [], [], set()
        for i in range(args.repeats):
            seconds, n = run_ladle(files, tok_dir, tmp / f"ladle{i}", args.workers)
            ladle_runs.append(n / seconds)
            tokens.add(n)
            seconds, n = run_datasets(files, tok_dir, tmp / f"datasets{i}", args.workers)
            datasets_runs.append(n / seconds)
            tokens.add(n)
    if len(tokens) != 1:
        print(f"warning: the two sides counted different token totals {sorted(tokens)}", file=sys.stderr)
    ladle_tps, datasets_tps = statistics.median(ladle_runs), statistics.median(datasets_runs)
    print(
        json.dumps(
            {
                "bench": "data_prepare",
                "machine": machine(),
                "corpus_mb": round(corpus_mb, 2),
                "files": len(files),
                "tokens": min(tokens),
                "ladle_tokens_per_s": round(ladle_tps),
                "datasets_tokens_per_s": round(datasets_tps),
                "ratio": round(ladle_tps / datasets_tps, 3),
                "workers": args.workers,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
