"""A prepared check for a lent GPU: GRPO with vLLM as the rollout engine (`grpo.engine: vllm`)
against ladle's own engine and trl's `GRPOTrainer` with vLLM colocated, on a 1B model.

A Llama-3.2-1B-shaped model (16 layers, dim 2048, 32 heads, 8 KV heads, FFN 8192; the benches'
8192-token vocabulary) with random weights, bf16-mixed, on the benches' stdlib prompts
(bench/grpo_throughput.py `prepare`): `--prompts` prompts x `--samples` samples a step,
`--new-tokens` response tokens, temperature 1. For each engine, `--steps` timed steps after one
warm-up: seconds per step, generation's share, rollout tokens/s, `weight_sync_s` and the largest
trainer-engine log-prob difference; then trl with `use_vllm=True, vllm_mode="colocate"` on the
same work when trl and vLLM import. Prints one JSON line:

    python bench/gpu_vllm_rollout.py [--prompts 8] [--samples 8] [--new-tokens 512] [--steps 3]

Needs vLLM for CUDA in the environment (`pip install 'ladle[vllm]'`); without it the line says so
and only ladle's engine runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

LLAMA_1B = {
    "vocab_size": 8192,
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_dim": 8192,
    "max_seq_len": 2048,
    "tie_embeddings": True,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench30m import bench_config
    from grpo_throughput import LR, prepare

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    if not torch.cuda.is_available():
        raise SystemExit("gpu_vllm_rollout: no CUDA device")
    have_vllm = importlib.util.find_spec("vllm") is not None
    engines = ["ladle", "vllm"] if have_vllm else ["ladle"]
    out: dict = {"bench": "gpu_vllm_rollout", "device": torch.cuda.get_device_name(), "vllm": have_vllm}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data, rendered = prepare(work, 64)
        for engine in engines:
            cfg = bench_config(
                LLAMA_1B, tok, data, seq_len=320 + a.new_tokens, steps=1 + a.steps,
                micro_batch=a.prompts, precision="bf16-mixed", lr=LR,
            )  # fmt: skip
            cfg.update(output_dir=str(work / engine), seed=0)
            cfg["grpo"] = {
                "num_samples": a.samples,
                "max_response_len": a.new_tokens,
                "engine": engine,
                "rollout_batch": a.prompts * a.samples,
                "micro_tokens": 8192,
            }
            cfg["rewards"] = {"file": str(work / "rewards.py"), "terms": [{"name": "has_def"}]}
            torch.cuda.reset_peak_memory_stats()
            load("grpo").run(build_config(cfg))
            recs = [r for r in read_metrics(work / engine) if "step_s" in r][1:]
            out[engine] = {
                "step_s": statistics.median(r["step_s"] for r in recs),
                "generation_share": statistics.median(r["gen_s"] / r["step_s"] for r in recs),
                "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in recs),
                "weight_sync_s": statistics.median(r.get("weight_sync_s", 0.0) for r in recs),
                "rollout_logprob_diff": max(r.get("rollout_logprob_diff", 0.0) for r in recs),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            }
        if have_vllm and importlib.util.find_spec("trl") is not None:
            out["trl_vllm_colocate_step_s"] = trl_vllm(tok, rendered, work / "trl", a)
    for engine in engines:
        if "trl_vllm_colocate_step_s" in out:
            out[engine]["speedup_over_trl_vllm"] = round(
                out["trl_vllm_colocate_step_s"] / out[engine]["step_s"], 3
            )
    print(json.dumps(out))


def trl_vllm(tok, rendered: list[str], out: Path, a) -> float:
    import datasets
    import transformers
    import trl
    from dpo_throughput import tokenizer
    from grpo_throughput import has_def
    from train_throughput import hf_args, step_timer

    m = LLAMA_1B
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=m["vocab_size"], hidden_size=m["dim"], num_hidden_layers=m["n_layers"],
            num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
            intermediate_size=m["ffn_dim"], max_position_embeddings=m["max_seq_len"],
            tie_word_embeddings=m["tie_embeddings"],
        )
    )  # fmt: skip
    times: list[float] = []
    args = trl.GRPOConfig(
        **hf_args(out, steps=1 + a.steps, batch=a.prompts * a.samples, lr=1e-6, bf16=True),
        num_generations=a.samples,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="bnpo",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
    )
    trl.GRPOTrainer(
        model=model,
        reward_funcs=has_def,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in rendered]),
        processing_class=tokenizer(tok),
        callbacks=[step_timer(times)],
    ).train()
    return statistics.median(times[1:])


if __name__ == "__main__":
    main()
