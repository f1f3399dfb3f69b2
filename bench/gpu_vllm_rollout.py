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
    a.warmup, a.precision, a.micro_tokens = 1, "bf16-mixed", 8192  # as bench/grpo_throughput.py reads them
    sys.path.insert(0, str(Path(__file__).parent))
    from grpo_throughput import ladle_run, prepare, trl_run

    if not torch.cuda.is_available():
        raise SystemExit("gpu_vllm_rollout: no CUDA device")
    have_vllm = importlib.util.find_spec("vllm") is not None
    engines = ["ladle", "vllm"] if have_vllm else ["ladle"]
    out: dict = {"bench": "gpu_vllm_rollout", "device": torch.cuda.get_device_name(), "vllm": have_vllm}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, data, rendered = prepare(work, 64)
        for engine in engines:
            torch.cuda.reset_peak_memory_stats()
            out[engine] = ladle_run(tok, data, work, work / engine, a, 320, engine, model=LLAMA_1B)
            out[engine]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if have_vllm and importlib.util.find_spec("trl") is not None:
            config = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
            out["trl_vllm_colocate_step_s"] = trl_run(tok, rendered, work / "trl", a, hf_llama_1b(), **config)
    for engine in engines:
        if "trl_vllm_colocate_step_s" in out:
            out[engine]["speedup_over_trl_vllm"] = round(
                out["trl_vllm_colocate_step_s"] / out[engine]["step_s"], 3
            )
    print(json.dumps(out))


def hf_llama_1b():
    """LLAMA_1B as a transformers model (random weights)."""
    import transformers

    m = LLAMA_1B
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=m["vocab_size"], hidden_size=m["dim"], num_hidden_layers=m["n_layers"],
            num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
            intermediate_size=m["ffn_dim"], max_position_embeddings=m["max_seq_len"],
            tie_word_embeddings=m["tie_embeddings"],
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
