"""DeepSeek-V3-shaped training: ladle's tokens/s against transformers' `DeepseekV3ForCausalLM`
under the `Trainer`, and the expert load with and without aux-loss-free balancing.

The model, *bench-30m-dsv3*, is bench-30m's frame (vocab 8192, dim 512, 8 layers, 8 heads, seq
512, micro-batch 8) in V3's shape: multi-head latent attention (q rank 192, kv rank 128, per head
64 without RoPE + 32 with it, values 64), the first layer dense (ffn 1408), then MoE layers of 8
routed experts (ffn 352) in 4 groups, 2 chosen per token from the best 2 groups by sigmoid score
plus the correction bias, and one shared expert. Both sides train that shape, with equal parameter
counts (asserted), on the same packed sequences of the Python standard library's source, with the
same precision, optimizer (fused AdamW) and threads, in one invocation; repeats alternate between
them. Each repeat runs ladle eager, ladle with `train.compile=true` (per-block torch.compile; the
MoE layer itself stays eager) and the Trainer; transformers runs its default experts
implementation (named in the output).

The balance runs train ladle's model from the same seed for `--balance-steps` steps with no
auxiliary loss, once without the bias update and once with `moe.bias_update_rate` at each of
`--rates` (micro-batch `--balance-batch`), and report the worst layer's max / mean tokens per expert (`moe_imbalance`: 1.0 is
even), the median over the last tenth of the steps, and the final loss. Prints one JSON line:

    python bench/moe_throughput.py [--repeats 3] [--steps 6] [--balance-steps 150]

Needs the bench extras (`pip install -e '.[bench]'`: transformers, accelerate).
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
import train_throughput
from bench30m import BENCH_30M, bench_config
from train_throughput import prepare_data

BENCH_DSV3 = {
    **BENCH_30M,
    "family": "deepseek_v3",
    "rope_interleaved": True,
    "mla": {
        "q_lora_rank": 192,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
    },
    "moe": {
        "n_experts": 8,
        "top_k": 2,
        "ffn_dim": 352,
        "scoring": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "dense_layers": 1,
        "norm_topk_prob": True,
        "aux_loss_weight": 0.0,
        "z_loss_weight": 0.0,
    },
}
SEQ, BATCH = 512, 8


def model_section(bias_update_rate: float = 0.0) -> dict:
    return {**BENCH_DSV3, "moe": {**BENCH_DSV3["moe"], "bias_update_rate": bias_update_rate}}


def ladle_run(
    tok,
    data,
    out: Path,
    *,
    steps: int,
    warmup: int,
    precision: str,
    rate: float = 0.0,
    batch: int = BATCH,
    compile: bool = False,
) -> list:
    from ladle.config.load import build_config
    from ladle.recipes import pretrain
    from ladle.train.metrics import read_metrics

    cfg = bench_config(
        model_section(rate),
        tok,
        data,
        seq_len=SEQ,
        steps=warmup + steps,
        micro_batch=batch,
        precision=precision,
        compile=compile,
    )
    pretrain.run(build_config({"output_dir": str(out), "seed": 0, **cfg}))
    return [r for r in read_metrics(out) if "tokens_per_s" in r][warmup:]


def hf_model():
    """The same shape as transformers' DeepseekV3ForCausalLM, from ladle's own config export."""
    import transformers

    from ladle.config import ModelConfig
    from ladle.models.hf import hf_config
    from ladle.models.llama import count_params

    cfg = ModelConfig(**BENCH_DSV3)
    d = hf_config(cfg)
    d.pop("architectures"), d.pop("model_type")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**d))
    model.config._attn_implementation = "sdpa"
    n = sum(p.numel() for p in model.parameters())
    assert n == count_params(cfg), (n, count_params(cfg))
    return model, n


def hf_run(data: Path, out: Path, *, steps: int, warmup: int, precision: str) -> dict:
    model, _ = hf_model()
    r = train_throughput.hf_run(data, steps, warmup, precision, out, model=model)
    return {**r, "experts": model.config._experts_implementation}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--balance-steps", type=int, default=150, help="0 skips the balance runs")
    ap.add_argument("--balance-batch", type=int, default=2, help="micro-batch of the balance runs")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.001, 0.01])
    args = ap.parse_args()

    from ladle import device as dev

    _, n_params = hf_model()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data = prepare_data(work)
        ours, compiled, theirs = [], [], []
        for r in range(args.repeats):
            for runs, compile in ((ours, False), (compiled, True)):
                recs = ladle_run(
                    tok,
                    data,
                    work / f"ladle{r}{compile}",
                    steps=args.steps,
                    warmup=args.warmup,
                    precision=args.precision,
                    compile=compile,
                )
                runs.append({k: statistics.median(x[k] for x in recs) for k in ("tokens_per_s", "mfu")})
            theirs.append(
                hf_run(data, work / f"hf{r}", steps=args.steps, warmup=args.warmup, precision=args.precision)
            )
            print(
                f"repeat {r}: ladle {ours[-1]['tokens_per_s']:.0f} tok/s, "
                f"ladle train.compile {compiled[-1]['tokens_per_s']:.0f} tok/s, "
                f"DeepseekV3ForCausalLM + Trainer {theirs[-1]['tokens_per_s']:.0f} tok/s",
                file=sys.stderr,
            )
        balance = {}
        for rate in [0.0, *args.rates] if args.balance_steps else []:
            recs = ladle_run(
                tok,
                data,
                work / f"bal{rate}",
                steps=args.balance_steps,
                warmup=0,
                precision=args.precision,
                rate=rate,
                batch=args.balance_batch,
            )
            tail = recs[-max(1, len(recs) // 10) :]
            balance[str(rate)] = {
                "max_over_mean": round(statistics.median(x["moe_imbalance"] for x in tail), 3),
                "final_loss": round(statistics.median(x["loss"] for x in tail), 4),
            }
            print(f"bias_update_rate {rate}: {balance[str(rate)]}", file=sys.stderr)
    device = dev.pick_device("auto")
    if not ours:  # --repeats 0: the balance runs only
        print(json.dumps({"bench": "moe_throughput", "imbalance_by_bias_update_rate": balance}))
        return
    ladle_tps = statistics.median(x["tokens_per_s"] for x in ours)
    compiled_tps = statistics.median(x["tokens_per_s"] for x in compiled)
    hf_tps = statistics.median(x["tokens_per_s"] for x in theirs)
    print(
        json.dumps(
            {
                "bench": "moe_throughput",
                "model": "bench-30m-dsv3",
                "params": n_params,
                "precision": args.precision,
                "machine": f"{platform.machine()} {dev.device_name(device)}, {torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "ladle_tokens_per_s": round(ladle_tps, 1),
                "transformers_tokens_per_s": round(hf_tps, 1),
                "ratio": round(ladle_tps / hf_tps, 3),
                "ladle_compiled_tokens_per_s": round(compiled_tps, 1),
                "ratio_compiled": round(compiled_tps / hf_tps, 3),
                "transformers_experts": theirs[0]["experts"],
                "ladle_mfu": round(statistics.median(x["mfu"] for x in ours), 4),
                "ladle_compiled_mfu": round(statistics.median(x["mfu"] for x in compiled), 4),
                "repeats": args.repeats,
                "steps": args.steps,
                "balance_steps": args.balance_steps,
                "imbalance_by_bias_update_rate": balance,
            }
        )
    )


if __name__ == "__main__":
    main()
