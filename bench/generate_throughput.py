"""Generation throughput of `ladle.models.generation.generate` against `transformers`' `generate`.

bench-30m with random weights (the same weights on both sides), batch 8, prompts of 64 random
tokens, 128 new tokens, greedy, no EOS, in one invocation with alternating repeats. ladle runs
twice: as it comes (on the CPU its linear weights are packed for oneDNN at the start of each
`generate` call, the packing timed with it) and with `prepack=False` (plain `F.linear`, the
matmul kernels transformers uses). Prints one JSON line with new tokens/s of each, the ratios to
transformers, how many leading tokens of each row agree with transformers', and the time of one
decode step's matmuls alone, plain and packed (`decode_matmuls`), and of one layer's attention
at the last step (`decode_attention`). `prefill` compares the two models' plain forwards on the
prompts: the largest difference of the last position's logits and the smallest gap between the
top two logits of a row (a gap under that difference is a near-tie that greedy decoding may
resolve either way):

    python bench/generate_throughput.py [--repeats 3] [--dtype float32|bfloat16] [--prompt-seed S]

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


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 3)


def decode_matmuls(model, batch: int) -> dict:
    """Median ms of one decode step's matmuls (every nn.Linear of the model on `batch` rows) with
    `F.linear` and with oneDNN-packed weights, and the time to pack them all once."""
    weights = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    t0 = time.perf_counter()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in weights]
    pack_s = time.perf_counter() - t0

    def plain():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    def onednn():
        for w, p in zip(weights, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    return {"plain_ms": median_ms(plain), "packed_ms": median_ms(onednn), "pack_ms": round(pack_s * 1e3, 1)}


def decode_attention(cfg, batch: int, keys: int, dtype) -> dict:
    """Median ms of one layer's decode-step attention (one query row per head against `keys`
    cached keys, the cache's mask): SDPA's GQA call, as transformers makes it, and ladle's
    `sdpa`, which puts the query heads of a kv head in as rows of one head."""
    from ladle.models.layers import sdpa

    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    q = torch.randn(batch, H, 1, D, dtype=dtype)
    k, v = (torch.randn(batch, K, keys, D, dtype=dtype) for _ in range(2))
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    gqa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    return {"keys": keys, "gqa_ms": median_ms(gqa), "ladle_ms": median_ms(lambda: sdpa(q, k, v, mask))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-seed", type=int, default=None, help="draw the prompts from this seed")
    args = ap.parse_args()

    import transformers

    from ladle.config import ModelConfig
    from ladle.models.generation import generate
    from ladle.models.hf import hf_config, to_hf_name
    from ladle.models.llama import build_model

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = ModelConfig(**BENCH_30M)
    ours = build_model(cfg).to(dtype).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg, pad_id=0)))
    hf.load_state_dict({to_hf_name(k): v for k, v in ours.state_dict().items()})
    hf = hf.to(dtype).eval()
    g = None if args.prompt_seed is None else torch.Generator().manual_seed(args.prompt_seed)
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
    with torch.no_grad():  # how far apart the two models' own forwards are, before any generation
        a, b = ours(prompts)[:, -1].float(), hf(input_ids=prompts).logits[:, -1].float()
        top2 = b.topk(2).values
    prefill = {
        "last_logits_max_diff": (a - b).abs().max().item(),
        "top2_margin_min": (top2[:, 0] - top2[:, 1]).min().item(),
    }

    def run_ladle(prepack=True):
        return generate(ours, prompts.tolist(), max_new_tokens=args.new_tokens, prepack=prepack)

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

    sides = {"ladle": run_ladle, "ladle_unpacked": lambda: run_ladle(prepack=False), "transformers": run_hf}
    for fn in sides.values():  # warm-up
        fn()
    times = {name: [] for name in sides}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    new = args.batch * args.new_tokens
    tps = {k: new / statistics.median(v) for k, v in times.items()}
    hf_out = outs["transformers"]
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
                **{f"{k}_tokens_per_s": round(v, 1) for k, v in tps.items()},
                "ratio": round(tps["ladle"] / tps["transformers"], 3),
                "ratio_unpacked": round(tps["ladle_unpacked"] / tps["transformers"], 3),
                **{
                    f"same_prefix_per_row{k[5:]}": [
                        same_prefix(a, b) for a, b in zip(outs[k], hf_out, strict=True)
                    ]
                    for k in ("ladle", "ladle_unpacked")
                },
                "decode_matmuls": decode_matmuls(ours, args.batch),
                "decode_attention": decode_attention(
                    cfg, args.batch, args.prompt_len + args.new_tokens, dtype
                ),
                "prefill": prefill,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
