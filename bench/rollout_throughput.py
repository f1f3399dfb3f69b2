"""Rollout throughput of ladle's two engines, with and without prefix sharing: `--prompts` prompts
of `--prompt-len` random tokens x `--samples` samples each, `--new-tokens` new tokens (no end
token: every row runs to the cap), temperature 1, bench-30m with random weights in fp32 (or
`--dtype bfloat16`), in one invocation with alternating repeats.

- `ladle`: the RL recipes' own engine (`LocalEngine`, keyed per-row streams, the KV cache), each
  prompt prefilled once for its samples (`sample(share_prefix=True)`, the default) or every row
  prefilled (`share_prefix=False`);
- `vllm`: vLLM in this process (`VLLMEngine`, as `grpo.engine: vllm` runs it), with its prefix
  cache (the default) or `enable_prefix_caching: false`; one engine start each, not timed, the
  weights synced once before the first repeat.

Prints one JSON line with the median new tokens/s of each (prefill included: a rollout's time)
and the ratios of sharing to not sharing:

    python bench/rollout_throughput.py [--repeats 3] [--prompts 8] [--samples 8] [--prompt-len 256] [--new-tokens 64] [--engines ladle,vllm]

`--moe`: bench-30m's MoE variant (Qwen3-MoE: 8 experts of 352, 2 a token, in every layer), and
for vLLM the cost of recording its routing (routing replay, `routing_agreement`): the engine as an
MoE policy's runs it against one that records nothing, both with the prefix cache.

`vllm` needs the extra (`make setup-vllm`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from bench30m import BENCH_30M


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default="ladle", help="comma-separated: ladle, vllm")
    ap.add_argument(
        "--moe", action="store_true", help="the MoE variant; vLLM with and without routing recorded"
    )
    a = ap.parse_args()

    from ladle import device as dev
    from ladle import distributed as dist
    from ladle.config.schema import ModelConfig, MoEConfig
    from ladle.models.generation import sample
    from ladle.models.llama import build_model
    from ladle.rl.rollout import Sampling

    dtype = getattr(torch, a.dtype)
    cfg = ModelConfig(**{**BENCH_30M, "max_seq_len": a.prompt_len + a.new_tokens})
    if a.moe:
        moe = MoEConfig(n_experts=8, top_k=2, ffn_dim=352)
        cfg = cfg.model_copy(update={"family": "qwen3_moe", "qk_norm": True, "moe": moe})
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)
    ]
    rows = [p for p in prompts for _ in range(a.samples)]
    sampling = Sampling(n=a.samples, temperature=1.0, max_new_tokens=a.new_tokens)
    new_tokens = len(rows) * a.new_tokens

    def ladle(share: bool):
        def run() -> float:
            gens = [torch.Generator().manual_seed(k) for k in range(len(rows))]
            t0 = time.perf_counter()
            out = sample(model, rows, max_new_tokens=a.new_tokens, temperature=1.0, row_generators=gens,
                         share_prefix=share)  # fmt: skip
            assert sum(map(len, out.tokens)) == new_tokens
            return new_tokens / (time.perf_counter() - t0)

        return run

    runs = {}
    if "ladle" in a.engines:
        runs["ladle shared"], runs["ladle unshared"] = ladle(True), ladle(False)
    if "vllm" in a.engines:
        from ladle.rl.vllm import VLLMEngine

        dist.init(torch.device("cpu"))
        variants = (  # label, prefix cache, routing recorded
            (("vllm routing recorded", True, True), ("vllm prefix cache", True, False))
            if a.moe
            else (("vllm prefix cache", True, False), ("vllm no prefix cache", False, False))
        )
        for label, caching, routing in variants:
            engine = VLLMEngine(
                model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), seed=0, end_ids=set(),
                decode=None, dtype=dtype, max_len=cfg.max_seq_len,
                engine_args={"enable_prefix_caching": caching}, device=torch.device("cpu"), routing=routing,
            )  # fmt: skip
            engine.sync_weights()

            def run(engine=engine) -> float:
                t0 = time.perf_counter()
                out = engine.generate(prompts, list(range(len(prompts))), sampling, step=0)
                tokens = sum(map(len, out.response_ids))
                return tokens / (time.perf_counter() - t0)

            runs[label] = run
    for fn in runs.values():  # warm-up: kernels, packing, the engines' first batch
        fn()
    got: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):
        for k, fn in runs.items():
            got[k].append(fn())
    med = {k: round(statistics.median(v), 1) for k, v in got.items()}
    ratios = {}
    if "ladle shared" in med:
        ratios["ladle"] = round(med["ladle shared"] / med["ladle unshared"], 3)
    if "vllm no prefix cache" in med:
        ratios["vllm"] = round(med["vllm prefix cache"] / med["vllm no prefix cache"], 3)
    recording = {}
    if "vllm routing recorded" in med:
        recording["vllm"] = round(med["vllm routing recorded"] / med["vllm prefix cache"], 3)
    print(
        json.dumps(
            {
                "bench": "rollout_throughput",
                "model": "bench-30m-moe" if a.moe else "bench-30m",
                "dtype": a.dtype,
                "machine": f"{platform.machine()} {dev.device_name(dev.pick_device('auto'))}, "
                f"{torch.get_num_threads()} threads",
                "torch": torch.__version__,
                "work": f"{a.prompts} prompts of {a.prompt_len} tokens x {a.samples} samples, {a.new_tokens} new tokens",
                "new_tokens_per_s_median": med,
                "sharing_speedup": ratios,
                **({"routing_recorded_over_not": recording} if recording else {}),
                "runs": {k: [round(x, 1) for x in v] for k, v in got.items()},
            }
        )
    )
    dist.shutdown()


if __name__ == "__main__":
    main()
