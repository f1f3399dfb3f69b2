"""SFT and LoRA throughput of ladle against `transformers`' Trainer (+ `peft` for LoRA), and the
memory of full finetuning, LoRA and QLoRA.

bench-30m (bench/bench30m.py) finetunes on synthetic chats (`ladle data synth --task sort`,
20,000 of them) packed into rows of 512 tokens, micro-batch 8, bf16-mixed, fused AdamW, one
thread per core. Both sides get the very same rows (token ids, targets with the prompt masked to
-100, positions restarting per chat); ladle also keeps the chats apart in attention (document
masks), which the Trainer's SDPA path does not do for packed rows, so ladle does a little more
work. LoRA: rank 16, alpha 32, on q/k/v/o/gate/up/down, on both sides. Repeats alternate between
the six runs (ladle eager, ladle with `train.compile=true`, the Trainer; for SFT and for LoRA)
so machine noise hits all alike. Prints one JSON line:

    python bench/sft_throughput.py [--repeats 3] [--steps 4] [--warmup 2]

Memory (`memory`): one optimizer step of each mode on the same model, then the bytes of the
parameters (NF4 storage included), of the gradients, and of the optimizer state, summed over
the tensors that exist: measured, not computed from a formula.

Needs the bench extras (`pip install -e '.[bench]'`) and peft (a dev extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench30m import BENCH_30M, bench_config

SEQ, MB = 512, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 16, "alpha": 32, "targets": TARGETS}


def prepare(work: Path) -> tuple[Path, Path]:
    from train_throughput import prepare_data

    from ladle.data.sft import prepare_sft
    from ladle.data.synthetic import write_task

    tok, _ = prepare_data(work)
    write_task("sort", work / "task", train=20000, val=10, seed=0)
    data = work / "sft"
    prepare_sft([work / "task" / "train.jsonl"], tokenizer=tok, output=data, progress=False)
    return tok, data


def ladle_run(tok, data, out, steps, warmup, lora: bool, compile: bool = False) -> float:
    from ladle.config.load import build_config
    from ladle.recipes import sft
    from ladle.train.metrics import read_metrics

    cfg = bench_config(
        BENCH_30M, tok, data, seq_len=SEQ, steps=warmup + steps, micro_batch=MB, precision="bf16-mixed",
        lr=1e-4, compile=compile,
    )  # fmt: skip
    cfg["output_dir"] = str(out)
    if lora:
        cfg["lora"] = LORA
    sft.run(build_config(cfg))
    return statistics.median([r["tokens_per_s"] for r in read_metrics(out) if "tokens_per_s" in r][warmup:])


def hf_run(data, out, steps, warmup, lora: bool) -> float:
    from torch.utils.data import Dataset

    from ladle.data.packing import SFTSamples
    from ladle.data.sft import SFTSplit

    rows = SFTSamples(SFTSplit(data), SEQ, packing=True, seed=0)

    class Rows(Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            r = rows.get(i)
            return {
                "input_ids": torch.from_numpy(r["tokens"]),
                "labels": torch.from_numpy(r["targets"]),
                "position_ids": torch.from_numpy(r["positions"]),
            }

    from train_throughput import hf_bench30m, hf_timed_train

    model = hf_bench30m()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)
        )

    step_s = hf_timed_train(
        model,
        Rows(),
        out,
        steps=steps,
        warmup=warmup,
        batch=MB,
        lr=1e-4,
        bf16=True,
        forward=lambda m, inputs: (
            m(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        ),
    )
    return MB * SEQ / step_s


def memory() -> dict:
    """Bytes of parameters, gradients and optimizer state after one step of each mode (fp32 model)."""
    from ladle.config.schema import LoRAConfig, ModelConfig
    from ladle.models.llama import build_model
    from ladle.models.lora import apply_lora
    from ladle.models.nf4 import quantize_linears
    from ladle.train.optim import param_groups

    out = {}
    for mode in ("full", "lora", "qlora"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**BENCH_30M))
        if mode == "qlora":
            quantize_linears(model)
        if mode != "full":
            apply_lora(model, LoRAConfig(**LORA))
        opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-4)
        tokens = torch.randint(0, BENCH_30M["vocab_size"], (1, 128))
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        params = nbytes(model.parameters()) + nbytes(model.buffers())  # NF4 storage is buffers
        grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
        state = nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out[mode] = {
            "params_mib": round(params / 2**20, 1),
            "grads_mib": round(grads / 2**20, 1),
            "optimizer_mib": round(state / 2**20, 1),
            "total_mib": round((params + grads + state) / 2**20, 1),
            "trainable_params": trainable,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    res = {k: [] for k in ("ladle_sft", "ladle_sft_compile", "trainer_sft")}
    res.update({k: [] for k in ("ladle_lora", "ladle_lora_compile", "trainer_peft_lora")})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare(work)
        for r in range(args.repeats):
            n, w = args.steps, args.warmup
            res["ladle_sft"].append(ladle_run(tok, data, work / f"ls{r}", n, w, False))
            res["ladle_sft_compile"].append(ladle_run(tok, data, work / f"lsc{r}", n, w, False, compile=True))
            res["trainer_sft"].append(hf_run(data, work / f"hs{r}", n, w, False))
            res["ladle_lora"].append(ladle_run(tok, data, work / f"ll{r}", n, w, True))
            res["ladle_lora_compile"].append(ladle_run(tok, data, work / f"llc{r}", n, w, True, compile=True))
            res["trainer_peft_lora"].append(hf_run(data, work / f"hl{r}", n, w, True))
            print(
                f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in res.items()), file=sys.stderr
            )
    med = {k: round(statistics.median(v), 1) for k, v in res.items()}
    print(
        json.dumps(
            {
                "bench": "sft_throughput",
                "model": "bench-30m",
                "machine": platform.machine(),
                "threads": torch.get_num_threads(),
                "rows": f"{MB} x {SEQ}",
                "repeats": args.repeats,
                "tokens_per_s_median": med,
                "sft_ratio": round(med["ladle_sft"] / med["trainer_sft"], 3),
                "sft_compile_ratio": round(med["ladle_sft_compile"] / med["trainer_sft"], 3),
                "lora_ratio": round(med["ladle_lora"] / med["trainer_peft_lora"], 3),
                "lora_compile_ratio": round(med["ladle_lora_compile"] / med["trainer_peft_lora"], 3),
                "runs": {k: [round(x, 1) for x in v] for k, v in res.items()},
                "memory": memory(),
            }
        )
    )


if __name__ == "__main__":
    main()
