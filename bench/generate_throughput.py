"""Generation throughput of `ladle.generation.generate` against `transformers`' `generate`.

bench-30m with random weights (the same weights on both sides), batch 8, prompts of 64 random
tokens, 128 new tokens, greedy, no EOS, in one invocation with alternating repeats. Prints one
JSON line with new tokens/s on each side, their ratio, and whether the generated tokens agree:

    python bench/generate_throughput.py [--repeats 3] [--dtype float32|bfloat16]

Needs the bench extras (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from bench30m import BENCH_30M


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share (greedy decoding diverges for good after one
    near-tie resolved differently by rounding)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    import transformers

    from ladle.config import ModelConfig
    from ladle.generation import generate
    from ladle.models.hf import hf_config, to_hf_name
    from ladle.models.llama import build_model

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = ModelConfig(**BENCH_30M)
    ours = build_model(cfg).to(dtype).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg, pad_id=0)))
    hf.load_state_dict({to_hf_name(k): v for k, v in ours.state_dict().items()})
    hf = hf.to(dtype).eval()
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len))

    def run_ladle():
        return generate(ours, prompts.tolist(), max_new_tokens=args.new_tokens)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(
                input_ids=prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[:, args.prompt_len :].tolist()

    run_ladle(), run_hf()  # warm-up
    times = {"ladle": [], "transformers": []}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in (("ladle", run_ladle), ("transformers", run_hf)):
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    new = args.batch * args.new_tokens
    tps = {k: new / statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "bench": "generate_throughput",
                "model": "bench-30m",
                "dtype": args.dtype,
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "ladle_tokens_per_s": round(tps["ladle"], 1),
                "transformers_tokens_per_s": round(tps["transformers"], 1),
                "ratio": round(tps["ladle"] / tps["transformers"], 3),
                "same_tokens": outs["ladle"] == outs["transformers"],
                "same_prefix_per_row": [
                    same_prefix(a, b) for a, b in zip(outs["ladle"], outs["transformers"], strict=True)
                ],
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
