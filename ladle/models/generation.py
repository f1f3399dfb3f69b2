"""Batched autoregressive generation with a KV cache: greedy, or temperature / top-k / top-p sampling.

Prompts of different lengths are left-padded into one batch. Pads get doc id 0 and real tokens doc id
1, so the model's document mask keeps real tokens from attending to pads; RoPE positions start at 0 at
each prompt's first real token, so a padded prompt generates exactly what it would alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ladle.models.moe import choices
from ladle.models.prepack import prepacked


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, V) with everything outside the top-k / top-p (nucleus) set at -inf.

    top_p keeps the smallest set of most likely tokens whose probability mass is >= top_p.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop = mass_before >= top_p  # the set already reached p without this token
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V): argmax when temperature == 0.
    `uniforms` (B,) in [0, 1): each row's token is the inverse of its cumulative distribution at
    its own uniform, so a row's draw depends on its stream alone, not on the batch's other rows."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
    if uniforms is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    cdf = probs.double().cumsum(-1)
    # right=True: the first token whose cumulative mass exceeds u, never a token of mass 0; u
    # rounding up to the total mass (~1e-16) takes the likeliest token
    at = (uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, at, right=True).squeeze(-1)
    return torch.where(idx < probs.shape[-1], idx, probs.argmax(-1))


@dataclass
class Sampled:
    """What `sample` drew per prompt: the new tokens, the log-prob of each under softmax(logits / T)
    (T = 1 when greedy), and whether the row ended by an end token or `stop` (not the cap)."""

    tokens: list[list[int]]
    logps: list[list[float]]
    finished: list[bool]
    # with `routing`: each row's MoE routing, (prompt + new tokens - 1, MoE layers, k) int16, the
    # experts the router chose for every token the model read (the last new token is never read)
    routing: list[torch.Tensor] | None = None


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    prepack: bool = True,
) -> list[list[int]]:
    """The new tokens for each prompt (up to and including eos_id, when given); see `sample`."""
    return sample(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        end_ids=set() if eos_id is None else {eos_id},
        pad_id=pad_id,
        generator=generator,
        stop=stop,
        prepack=prepack,
        logps=False,
    ).tokens


@torch.no_grad()  # not inference_mode: FSDP2 gathers into its parameters' buffers in place
def sample(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    end_ids: set[int] = frozenset(),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    row_generators: list[torch.Generator] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    prepack: bool = True,
    logps: bool = True,
    sync: Callable[[bool], bool] | None = None,
    seq_multiple: int = 1,
    share_prefix: bool = True,
    routing: bool = False,
) -> Sampled:
    """New tokens for each prompt, each row up to and including a token of `end_ids`.
    `stop(new_tokens)`, called after each token of a row, ends that row when true (see
    `stop_strings`). `row_generators`: one CPU generator per row, each drawing that row's uniform
    per token (`sample_next`), instead of one `generator` for the batch. `sync(all rows done
    here)` -> whether to stop: the caller's agreement across ranks that each run the same passes.

    `model` is a ladle Llama (anything with `new_cache` and `forward(tokens, positions, doc_ids,
    cache, logits_to_keep)`). The whole batch is prefilled in one forward pass, each distinct
    prompt once (`share_prefix`: rows of the same prompt, a prompt's samples, get copies of its
    cache), then one token per step through the KV cache. On the CPU the linear weights are
    packed for oneDNN first (ladle/models/prepack.py; 1.5-1.8x the tokens/s of plain `F.linear` on bench-30m in fp32,
    equal to it up to rounding); callers that generate many batches with the same weights wrap
    the calls in one `prepacked(model)` to pack once. `prepack=False` keeps `F.linear`.

    `seq_multiple` m > 1: every forward pass gets a multiple of m positions, as tensor parallelism's
    sequence shards need (m = tp): the prompts are left-padded to a multiple of m, and each decode
    step feeds m - 1 pad positions (document id 0: no real token attends to them) before the real
    one. The cache holds m slots a step; the logits of the last position are the real token's.
    Vocabulary-sharded logits (a DTensor) are gathered at that position only.

    `routing`: an MoE model's routing is recorded (`Sampled.routing`), for routing replay.
    """
    if routing and seq_multiple > 1:
        raise ValueError("routing is recorded without sequence sharding (seq_multiple 1)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt needs at least one token")
    if row_generators is not None and len(row_generators) != len(prompts):
        raise ValueError("one row generator per prompt")
    m = seq_multiple
    B, P = len(prompts), max(len(p) for p in prompts)
    P = -(-P // m) * m
    out: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    done = [False] * B
    if max_new_tokens <= 0:
        return Sampled(out, lps, done, [] if routing else None)
    device = next(model.parameters()).device

    # Rows with the same prompt (the samples of one) share its prefill: each distinct prompt is
    # prefilled once, and its cache and last logits are copied to its rows.
    first: dict[tuple[int, ...], int] = {}
    rep = [first.setdefault(tuple(p), len(first)) for p in prompts] if share_prefix else list(range(B))
    unique = [list(p) for p in first] if share_prefix else prompts
    U = len(unique)
    tokens = torch.full((U, P), pad_id, dtype=torch.long)
    doc_ids = torch.zeros((U, P), dtype=torch.long)  # 0: pad, 1: prompt
    for i, p in enumerate(unique):
        tokens[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        doc_ids[i, P - len(p) :] = 1
    tokens, doc_ids = tokens.to(device), doc_ids.to(device)
    positions = (doc_ids.cumsum(1) - 1).clamp(min=0)  # (U, P): 0 at each prompt's first real token

    cache = model.new_cache(U, P + max_new_tokens * m, device=device)
    scale = temperature if temperature > 0 else 1.0
    with prepacked(model, batch=B) if prepack else contextlib.nullcontext():
        logits = last(model(tokens, positions=positions, doc_ids=doc_ids, cache=cache, logits_to_keep=1))
        steps = []  # each forward's routing: the prefill's (U, P, L, k), then a step's (B, L, k)
        if routing:
            c = choices(model)  # (U * P, L, k)
            steps.append(c.view(U, P, *c.shape[1:]).to(torch.int16).cpu())
        if U < B:
            rows = torch.tensor(rep, device=device)
            cache.select(rows)
            logits, positions = logits[rows], positions[rows]
        pos = positions[:, -1:] + 1  # (B, 1)
        ones = torch.ones((B, 1), dtype=torch.long, device=device)
        if m > 1:  # each step: m - 1 pads, then the real token
            ones = torch.cat([torch.zeros((B, m - 1), dtype=torch.long, device=device), ones], 1)
            pads = torch.full((B, m - 1), pad_id, dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            u = None
            if row_generators is not None and temperature > 0:
                u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in row_generators])
            nxt = sample_next(logits, temperature, top_k, top_p, generator, u)  # (B,)
            lp = None
            if logps:
                lp = torch.log_softmax(logits.float() / scale, -1).gather(1, nxt[:, None])[:, 0].tolist()
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
                    if lp is not None:
                        lps[i].append(lp[i])
                    done[i] = t in end_ids or (stop is not None and stop(out[i]))
            finished = all(done) if sync is None else sync(all(done))
            if finished or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding (their tokens are dropped): simpler than shrinking the batch.
            step_tokens = nxt[:, None] if m == 1 else torch.cat([pads, nxt[:, None]], 1)
            logits = last(model(step_tokens, positions=pos.expand(B, m), doc_ids=ones, cache=cache))
            if routing:
                steps.append(choices(model).to(torch.int16).cpu())
            pos = pos + 1
    if not routing:
        return Sampled(out, lps, done)
    rows = []
    for i, p in enumerate(prompts):  # the prompt's prefill (its rows' shared one), then each token fed
        fed = [steps[1 + s][i] for s in range(len(out[i]) - 1)]
        rows.append(torch.cat([steps[0][rep[i], P - len(p) :], *(f[None] for f in fed)]))
    return Sampled(out, lps, done, rows)


def last(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) logits of the last position; vocabulary shards (tensor parallel) gathered."""
    x = logits[:, -1]
    return x.full_tensor() if isinstance(x, DTensor) else x


def stop_strings(decode: Callable[[list[int]], str], strings: list[str]) -> Callable[[list[int]], bool]:
    """A `stop` for generate: true once the decoded new tokens contain one of `strings`. Only the
    tail is decoded (a stop string spans at most that many tokens, since a token is at least one
    byte), so each check costs the same however long the output grows."""
    strings = [x for x in strings if x]
    window = max((len(x.encode("utf-8")) for x in strings), default=0) + 8

    def stop(tokens: list[int]) -> bool:
        tail = decode(tokens[-window:])
        return any(x in tail for x in strings)

    return stop


def truncate_at_stop(text: str, strings: list[str]) -> str:
    """`text` up to (without) the first occurrence of any of `strings`."""
    cut = min((i for x in strings if x and (i := text.find(x)) >= 0), default=len(text))
    return text[:cut]
