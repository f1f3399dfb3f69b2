"""Training throughput of ladle's pretrain recipe against a plain Hugging Face `Trainer`.

The reference model *bench-30m* (vocab 8192, dim 512, 8 layers, 8 heads, 4 KV heads, ffn 1408,
seq 512, micro-batch 8) trains on the Python standard library's source, tokenized by a BPE
trained on it. Both sides train the same model shape on the same packed sequences, with the same
precision, optimizer (fused AdamW) and threads, in one invocation; repeats alternate between them
so machine noise hits both alike. Prints one JSON line:

    python bench/train_throughput.py [--repeats 3] [--steps 6] [--precision bf16-mixed]

Each repeat runs ladle eager, ladle with `train.compile=true` (per-block torch.compile), and the
Trainer (eager, as it ships by default).

Needs the bench extras (`pip install -e '.[bench]'`: transformers, accelerate).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from bench30m import BENCH_30M, bench_config

EXCLUDE = ["site-packages/*", "test/*", "idlelib/idle_test/*", "lib2to3/tests/*"]


def prepare_data(work: Path) -> tuple[Path, Path]:
    from ladle.data.prepare import prepare
    from ladle.data.tokenizer import train_tokenizer

    stdlib = sysconfig.get_paths()["stdlib"]
    tok = train_tokenizer([stdlib], vocab_size=8192, output=str(work / "tok"), glob="*.py", exclude=EXCLUDE)
    data = work / "data"
    prepare(
        [stdlib],
        tokenizer=str(tok),
        output=str(data),
        glob="*.py",
        exclude=EXCLUDE,
        val_fraction=0.0,
        progress=False,
    )
    return tok, data


def ladle_run(
    tok: Path, data: Path, out: Path, steps: int, warmup: int, precision: str, compile: bool
) -> dict:
    from ladle.config.load import build_config
    from ladle.recipes import pretrain
    from ladle.train.metrics import read_metrics

    cfg = bench_config(
        BENCH_30M,
        tok,
        data,
        seq_len=512,
        steps=warmup + steps,
        micro_batch=8,
        precision=precision,
        compile=compile,
    )
    cfg = build_config({"output_dir": str(out), "seed": 0, **cfg})
    pretrain.run(cfg)
    recs = [r for r in read_metrics(out) if "tokens_per_s" in r][warmup:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
        "mfu": statistics.median(r["mfu"] for r in recs),
    }


def hf_bench30m(head: str = "LlamaForCausalLM", **extra):
    """bench-30m as a transformers Llama model with `head` (seed 0, SDPA attention); `extra`
    config keys (num_labels, pad_token_id for a sequence classifier)."""
    import transformers

    m = BENCH_30M
    config = transformers.LlamaConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["dim"],
        num_hidden_layers=m["n_layers"],
        num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"],
        intermediate_size=m["ffn_dim"],
        max_position_embeddings=m["max_seq_len"],
        tie_word_embeddings=m["tie_embeddings"],
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, head)(config)
    model.config._attn_implementation = "sdpa"
    return model


def hf_run(data: Path, steps: int, warmup: int, precision: str, out: Path, model=None) -> dict:
    """The Trainer on `model` (default: bench-30m as LlamaForCausalLM), seq 512, micro-batch 8."""
    from torch.utils.data import Dataset

    from ladle.data.loader import PackedSamples
    from ladle.data.prepare import open_split

    samples = PackedSamples(open_split(data, "train"), 512)

    class Packed(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            s = samples.get(i)
            return {"input_ids": torch.from_numpy(s["tokens"]), "labels": torch.from_numpy(s["targets"])}

    step_s = hf_timed_train(
        model if model is not None else hf_bench30m(),
        Packed(),
        out,
        steps=steps,
        warmup=warmup,
        batch=8,
        lr=3e-4,
        bf16=precision == "bf16-mixed",
        forward=lambda model, inputs: model(input_ids=inputs["input_ids"]).logits,
    )
    return {"tokens_per_s": 8 * 512 / step_s}


def hf_timed_train(model, dataset, out: Path, *, steps, warmup, batch, lr, bf16, forward) -> float:
    """Median seconds of a step of transformers' Trainer after `warmup` steps. `forward(model,
    inputs)` gives the logits; the loss is fp32 cross-entropy against `labels`, which are already
    the next tokens (-100 ignored): HF's own loss would shift them again."""
    import transformers

    class Shifted(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = forward(model, inputs)
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), inputs["labels"].flatten())

    times: list[float] = []
    args = transformers.TrainingArguments(**hf_args(out, steps=warmup + steps, batch=batch, lr=lr, bf16=bf16))
    Shifted(model=model, args=args, train_dataset=dataset, callbacks=[step_timer(times)]).train()
    return statistics.median(times[warmup:])


def hf_args(out: Path, *, steps, batch, lr, bf16) -> dict:
    """The TrainingArguments of a timed peer run (trl's configs take the same keys)."""
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=lr,
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
    )


def step_timer(times: list[float]):
    """A Trainer callback that appends each optimizer step's wall seconds to `times`."""
    import transformers

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    return Timer()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    args = ap.parse_args()

    from ladle import device as dev
    from ladle.config import ModelConfig
    from ladle.models.llama import count_params
    from ladle.train.metrics import flops_per_token

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare_data(work)
        ours, compiled, theirs = [], [], []
        for r in range(args.repeats):
            ours.append(
                ladle_run(tok, data, work / f"ladle{r}", args.steps, args.warmup, args.precision, False)
            )
            compiled.append(
                ladle_run(tok, data, work / f"ladlec{r}", args.steps, args.warmup, args.precision, True)
            )
            theirs.append(hf_run(data, args.steps, args.warmup, args.precision, work / f"hf{r}"))
            print(
                f"repeat {r}: ladle {ours[-1]['tokens_per_s']:.0f} tok/s, "
                f"ladle train.compile {compiled[-1]['tokens_per_s']:.0f} tok/s, "
                f"Trainer {theirs[-1]['tokens_per_s']:.0f} tok/s",
                file=sys.stderr,
            )
    cfg = ModelConfig(**BENCH_30M)
    fpt = flops_per_token(
        count_params(cfg, exclude_embeddings=True), cfg.n_layers, cfg.n_heads, cfg.head_size, 512
    )
    device = dev.pick_device("auto")
    peak, source = dev.peak_tflops(device, dev.compute_dtype_name(args.precision))
    ladle_tps = statistics.median(x["tokens_per_s"] for x in ours)
    compiled_tps = statistics.median(x["tokens_per_s"] for x in compiled)
    hf_tps = statistics.median(x["tokens_per_s"] for x in theirs)
    print(
        json.dumps(
            {
                "bench": "train_throughput",
                "model": "bench-30m",
                "precision": args.precision,
                "machine": f"{platform.machine()} {dev.device_name(device)}, {torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "ladle_tokens_per_s": round(ladle_tps, 1),
                "trainer_tokens_per_s": round(hf_tps, 1),
                "ratio": round(ladle_tps / hf_tps, 3),
                "ladle_compiled_tokens_per_s": round(compiled_tps, 1),
                "ratio_compiled": round(compiled_tps / hf_tps, 3),
                "ladle_mfu": round(statistics.median(x["mfu"] for x in ours), 4),
                "ladle_compiled_mfu": round(statistics.median(x["mfu"] for x in compiled), 4),
                "trainer_mfu": round(hf_tps * fpt / (peak * 1e12), 4),
                "peak_tflops": round(peak, 4),
                "peak_source": source,
                "repeats": args.repeats,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
