"""A Llama-family decoder (Llama 2/3, Qwen2 with `qkv_bias`, Qwen3 with `qk_norm`; with `moe`, Mixtral
and Qwen3-MoE, see ladle/models/moe.py) in plain PyTorch.

Module names mirror Hugging Face's `LlamaModel`, so our state_dict keys are HF's without the `model.`
prefix (see `ladle.models.hf`). RoPE uses HF's rotate_half layout, so HF checkpoints load unpermuted.

Conventions a caller must know:
- Tied embeddings: there is no `lm_head` module; the head is `F.linear(x, embed_tokens.weight)` and the
  state_dict has no `lm_head.weight` key (as in HF checkpoints).
- `rotary_emb.inv_freq` is a non-persistent fp32 buffer: not in the state_dict, recomputed by
  `init_buffers()` (called by `init_weights()` and `build_model`). Call it again after `model.to(bf16)`,
  which would otherwise round the frequencies to bf16.
- Logits come out in the compute dtype (fp32 params -> fp32; bf16 params or autocast -> bf16).
- MoE models leave each forward's router statistics in `model.router_stats` (one tuple per layer:
  load-balancing loss, z-loss, tokens per expert); the training loop adds the weighted losses.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ladle.config.schema import ModelConfig
from ladle.models.layers import (
    MLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    pick,
    rope_inv_freq,
    sdpa,
    to_compute_dtype,
)
from ladle.models.moe import MoE, init_moe


class KVCache:
    """Preallocated keys/values for generation, one (B, n_kv_heads, max_len, head_dim) pair per layer,
    allocated at the layer's first `update` with the heads it computes (under tensor parallelism a
    rank's share of them).

    `doc_ids` (B, max_len) holds the document id of every cached key, so the same doc_ids mask that
    separates packed documents also hides left padding (pads: id 0, real tokens: id 1). `length` is the
    number of filled slots; `Llama.forward` writes at [length, length + T) and then advances it.
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, device=None, dtype=torch.float32):
        self.shape = (batch, n_kv_heads, max_len, head_dim)
        self.device, self.dtype = device, dtype
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.doc_ids = torch.zeros(batch, max_len, device=device, dtype=torch.long)
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, K, T, D) for `layer`; return all cached ones (B, K, length + T, D).
        k and v may differ in heads and size (MLA caches its latent and its shared roped key)."""
        if self.k[layer] is None:
            B, _, L, _ = self.shape
            kw = {"device": self.device, "dtype": self.dtype}
            self.k[layer] = torch.zeros((B, k.shape[1], L, k.shape[3]), **kw)
            self.v[layer] = torch.zeros((B, v.shape[1], L, v.shape[3]), **kw)
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cached rows `rows` (indices, repeats allowed): a prompt's prefill copied to
        each of its samples."""
        for cached in (self.k, self.v):
            for layer, t in enumerate(cached):
                if t is not None:
                    cached[layer] = t.index_select(0, rows)
        self.doc_ids = self.doc_ids.index_select(0, rows)
        self.shape = (len(rows), *self.shape[1:])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.window = window  # sliding-window attention: positions a query sees, its own included
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(cfg.dim, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, K * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, K * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.dim, bias=False)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k, before RoPE
            self.q_norm = RMSNorm(D, cfg.norm_eps)
            self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.interleaved = cfg.rope_interleaved

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None, layer: int = 0, at=None):
        """at (B,): queries at that one position of each row only (see `Llama.forward`)."""
        B, T, _ = x.shape
        D = self.head_dim
        xq, cq, sq = (x, cos, sin) if at is None else (pick(x, at), pick(cos, at), pick(sin, at))
        Tq = xq.shape[1]
        # Head counts from the shapes (-1): under tensor parallelism the projections hold only
        # this rank's H / tp and K / tp heads (ladle/parallel/tp.py).
        q = self.q_proj(xq).view(B, Tq, -1, D)
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        q, k = apply_rope(q, cq, sq, self.interleaved), apply_rope(k, cos, sin, self.interleaved)
        if at is not None:  # each query sees the keys up to its own position (and within its window)
            k_pos = torch.arange(T, device=x.device)
            seen = k_pos <= at[:, None]
            if self.window is not None:
                seen = seen & (k_pos > at[:, None] - self.window)
            mask = seen[:, None, None, :]  # (B, 1, 1, T)
        y = self.attend(q, k, v, mask, cache, layer)  # (B, H, Tq, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, Tq, -1))

    def attend(self, q, k, v, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, K, S, D), S = cached + T
            k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless the cache dtype differs (autocast)
        # Grouped-query attention (each kv head serves H/K query heads) is left to SDPA's
        # enable_gqa: no repeated copies of k/v, and no reduction of them in backward.
        if mask is not None and not isinstance(mask, torch.Tensor):  # PackedMask, or the caller's
            return mask.attend(q, k, v)
        return sdpa(q, k, v, mask)


def layer_window(cfg: ModelConfig, layer: int) -> int | None:
    """The sliding window of layer `layer`, None where it attends in full (Qwen2's max_window_layers)."""
    if cfg.sliding_window is None or layer < cfg.max_window_layers:
        return None
    return cfg.sliding_window


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        from ladle.models.mla import MLA

        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = (MLA if cfg.mla else Attention)(cfg, layer_window(cfg, layer))
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        sparse = cfg.moe is not None and layer >= cfg.moe.dense_layers  # DeepSeek: the first k dense
        self.mlp = MoE(cfg, layer - cfg.moe.dense_layers) if sparse else MLP(cfg)
        if cfg.post_norms:  # GLM-4-0414: each branch's output normalised before its residual add
            self.post_self_attn_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_norms = cfg.post_norms

    def forward(self, x, cos, sin, mask=None, cache=None, layer=0, at=None, replay=None):
        """-> (x, router statistics or None for a dense MLP); (B, 1, dim) at `at` (see `Llama.forward`);
        `replay`: an MoE layer's experts to use (routing replay, `MoE.forward`)."""
        h = to_compute_dtype(self.input_layernorm(x))  # every position: keys and values need it
        if at is not None:
            x = pick(x, at)
        # `at` by keyword: tensor parallelism's input hook on self_attn lays out the positional ones
        a = self.self_attn(h, cos, sin, mask, cache, layer, at=at)
        x = x + (self.post_self_attn_layernorm(a) if self.post_norms else a)
        h = to_compute_dtype(self.post_attention_layernorm(x))
        y = self.mlp(h) if replay is None else self.mlp(h, replay=replay)
        y, router = y if isinstance(y, tuple) else (y, None)
        return x + (self.post_mlp_layernorm(y) if self.post_norms else y), router


class PackedMask:
    """Document masking for a packed batch, paid only by the rows that hold a document boundary.

    Most packed rows lie inside one document, where the mask is plain causal: those take SDPA's
    causal fast path. `Llama.forward` reorders the batch so that those rows come first
    (`order`), attention splits it in two contiguous parts (split/cat: no scatter in backward),
    and the hidden states return to the caller's order before the head.
    """

    def __init__(self, doc_ids: torch.Tensor):
        self.doc_ids = doc_ids
        boundary = (doc_ids != doc_ids[:, :1]).any(1)  # (B,)
        self.order = torch.argsort(boundary.to(torch.uint8), stable=True)  # causal-only rows first
        self.n_plain = int((~boundary).sum())
        d = doc_ids[self.order[self.n_plain :]]
        self.mask = attention_mask(d, d, 0)  # (b, 1, T, T) for the rows with a boundary

    @property
    def mixed(self) -> bool:
        return 0 < self.n_plain < len(self.order)

    def windowed(self, window: int) -> torch.Tensor:
        """The document mask of every row (in `order`) narrowed to a sliding window: an explicit
        (B, 1, T, T) mask, since the causal fast path cannot take a window."""
        d = self.doc_ids[self.order]
        T = d.shape[1]
        return attention_mask(d, d, 0) & window_band(0, T, T, window, d.device)

    def attend(self, q, k, v) -> torch.Tensor:
        """q (B, H, T, D), k/v (B, K, T, D), rows in `order`; returns (B, H, T, D)."""
        B = q.shape[0]
        if self.n_plain == B:
            return sdpa(q, k, v)
        if self.n_plain == 0:
            return sdpa(q, k, v, self.mask)
        sizes = [self.n_plain, B - self.n_plain]
        (qp, qr), (kp, kr), (vp, vr) = q.split(sizes), k.split(sizes), v.split(sizes)
        return torch.cat([sdpa(qp, kp, vp), sdpa(qr, kr, vr, self.mask)])


def window_band(start: int, T: int, S: int, window: int, device) -> torch.Tensor:
    """(T, S) bool: key slot j is within `window` positions of query slot i (start + i), i - j < window."""
    q_idx = torch.arange(start, start + T, device=device)
    return torch.arange(S, device=device)[None, :] > q_idx[:, None] - window


def windowed(mask, window: int, T: int, device) -> torch.Tensor | object:
    """`mask` (None: plain causal; a (B, 1, T, S) bool mask; a PackedMask; a context-parallel
    attention) narrowed to a sliding window."""
    if mask is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        return (causal & window_band(0, T, T, window, device))[None, None]
    if isinstance(mask, torch.Tensor):
        S = mask.shape[-1]
        return mask & window_band(S - T, T, S, window, device)
    return mask.windowed(window)


def attention_mask(doc_q: torch.Tensor, doc_k: torch.Tensor, start: int) -> torch.Tensor:
    """(B, 1, T, S) bool, True = may attend: key j is at or before query i and in the same document.

    Queries sit at cache slots [start, start + T), keys at [0, S). A query always sees itself (same slot,
    same doc id), so no row is fully masked and softmax never yields NaN, even for pad tokens.
    """
    T, S = doc_q.shape[1], doc_k.shape[1]
    q_idx = torch.arange(start, start + T, device=doc_q.device)
    k_idx = torch.arange(S, device=doc_q.device)
    causal = k_idx[None, :] <= q_idx[:, None]  # (T, S)
    same_doc = doc_q[:, :, None] == doc_k[:, None, :]  # (B, T, S)
    return (causal[None] & same_doc)[:, None]  # (B, 1, T, S)


class TiedHead(nn.Module):
    """The output head of tied embeddings: logits from the embedding matrix."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.head == "score":  # a reward model: one scalar per position (HF's score.weight)
            self.score = nn.Linear(cfg.dim, 1, bias=False)
        elif not cfg.tie_embeddings:  # tied: the head reuses embed_tokens.weight, no separate key
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        else:
            self.tied_head = TiedHead()  # no parameters: a module so that layouts can wrap it
        self.rotary_emb = RotaryEmbedding(cfg)
        self.router_stats: list[tuple[torch.Tensor, ...]] = []
        self.init_weights()  # free on the meta device; build_model initialises again after to_empty

    def forward(
        self,
        tokens,
        positions=None,
        doc_ids=None,
        cache: KVCache | None = None,
        attention=None,
        logits_to_keep=0,
        at=None,
        keep=None,
        routing=None,
    ):
        """tokens (B, T) -> logits (B, T, vocab), or (B, logits_to_keep, vocab) for the last positions
        ((B, T, 1) scores with `head: score`).

        positions (B, T): RoPE position of each token (default: 0.., or continuing after the cache).
        doc_ids (B, T): packed documents; a token attends only to earlier tokens with the same id.
        cache: generation; this call's keys are appended to it (doc_ids default to 1 there).
        attention: an object whose `attend(q, k, v)` replaces the causal or document attention
        (context parallelism passes one that joins the sequence's shards, ladle/parallel/cp.py).
        logits_to_keep: > 0 computes the head for the last positions only (generation's prefill
        needs one: the whole (B, T, vocab) would be 8 GiB for 8 x 2048 tokens of Llama 3).
        at (B,): the output at that one position of each row only, (B, 1, ...): a reward model's
        score at each row's last token. The final block computes the query, attention and MLP of
        that position alone (keys and values of all), 1 / n_layers less work than scoring every
        position. Plain causal rows only, and not under tensor parallelism, whose sequence
        parallelism leaves each rank a slice of the positions.
        keep (B, T) bool: the head at those positions only, (N, vocab) in row-major order: the RL
        losses need the logits of response positions, not of the prompts (no TP, as `at`).
        routing (B, T, MoE layers, k): routing replay, the experts each token goes to in each MoE
        layer (-1: the router's own choice), as the sampler chose them (ladle/rl/rollout.py).
        """
        if at is not None and (cache is not None or attention is not None or doc_ids is not None):
            raise ValueError("at: plain causal rows only (no KV cache, documents or attention override)")
        B, T = tokens.shape[:2]  # (B, T), or (B, T, dim) hidden states at a pipeline stage
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        mask = None  # no docs, no cache: plain causal attention, SDPA's fast path
        if cache is not None:
            if start + T > cache.max_len:
                raise ValueError(f"KV cache overflow: {start} cached + {T} new > max_len {cache.max_len}")
            if doc_ids is None:
                doc_ids = torch.ones_like(tokens)
            cache.doc_ids[:, start : start + T] = doc_ids
            mask = attention_mask(doc_ids, cache.doc_ids[:, : start + T], start)  # (B, 1, T, start + T)
        elif attention is not None:
            mask = attention
        elif doc_ids is not None:
            # Packed documents: rows without a boundary keep the causal fast path (about half
            # the attention cost of an explicit mask); the others get the document mask.
            mask = PackedMask(doc_ids)
            if mask.mixed:  # rows without a boundary first (see PackedMask)
                tokens, positions = tokens[mask.order], positions[mask.order]
                routing = routing[mask.order] if routing is not None else None
        if routing is not None and at is not None:
            raise ValueError("routing replay scores every position: not with `at`")

        # A pipeline stage after the first has no embedding: its input is the hidden states.
        x = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens  # (B, T, dim)
        cos, sin = self.rotary_emb(positions, x.dtype)  # (B, T, head_dim) each
        router_stats = []
        blocks = list(self.blocks())
        window_mask = None  # sliding-window layers' mask, built once for all of them
        for n, (i, layer) in enumerate(blocks):
            layer_mask = mask
            window = layer.self_attn.window
            if window is not None and window < (start + T):  # a window as long as the keys: plain causal
                if window_mask is None:
                    window_mask = windowed(mask, window, T, tokens.device)
                layer_mask = window_mask
            replay = None
            if routing is not None and isinstance(layer.mlp, MoE):
                replay = routing[:, :, layer.mlp.ordinal]
            # positional: the activation-checkpointing wrappers pass positional arguments only
            x, router = layer(x, cos, sin, layer_mask, cache, i, at if n == len(blocks) - 1 else None, replay)
            if router is not None:
                router_stats.append(router)
        self.router_stats = router_stats
        if isinstance(mask, PackedMask) and mask.mixed:
            x = x[torch.argsort(mask.order)]  # back to the caller's row order
        if self.norm is None:  # a pipeline stage before the last hands its hidden states on
            return x
        if cache is not None:
            cache.length += T
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # the norm is per position: norm then slice is the same
        if keep is not None:
            x = x[keep]  # (N, dim)
        x = self.norm(x)
        if self.cfg.head == "score":
            return self.score(x)  # (B, T, 1)
        if self.cfg.tie_embeddings:
            return self.tied_head(x, self.embed_tokens.weight)  # (B, T, vocab)
        return self.lm_head(x)  # (B, T, vocab)

    def blocks(self):
        """(index, block) pairs. A pipeline stage keeps a slice of the blocks in an nn.ModuleDict
        keyed by their index in the whole model, so parameter names stay the model's."""
        if isinstance(self.layers, nn.ModuleDict):
            return ((int(k), b) for k, b in self.layers.items())
        return enumerate(self.layers)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        """An empty KV cache; device and dtype default to the model's parameters."""
        w = self.embed_tokens.weight
        return KVCache(
            self.cfg.n_layers, batch, self.cfg.kv_heads, max_len, self.cfg.head_size,
            device=device or w.device, dtype=dtype or w.dtype,
        )  # fmt: skip

    @torch.no_grad()
    def init_buffers(self):
        """(Re)compute the RoPE frequencies in fp32 on the parameters' device (after to_empty or .to(dtype))."""
        self.rotary_emb.inv_freq = rope_inv_freq(self.cfg, device=next(self.parameters()).device)

    @torch.no_grad()
    def init_weights(self):
        """normal(0, init_std) weights; o_proj/down_proj std / sqrt(2 * n_layers), since each layer adds
        two residual branches (GPT-2); norms 1, biases 0. Experts and routers alike."""
        init_modules(self, self.cfg)
        self.init_buffers()


@torch.no_grad()
def init_modules(root: nn.Module, cfg: ModelConfig, prefix: str = "") -> None:
    """The init of `Llama.init_weights` for `root` and its submodules, `root` being the module
    named `prefix` in the model. The random draws follow named_modules' order, so initialising the
    model's top-level parts one after another in that order gives the same weights as one call
    on the whole model (the sharded start-up does that, ladle/parallel/init.py)."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for sub, m in root.named_modules():
        name = f"{prefix}.{sub}" if prefix and sub else prefix or sub
        if isinstance(m, MoE):
            init_moe(m, std, out_std)
        elif isinstance(m, nn.Linear) and not name.endswith("mlp.gate"):
            nn.init.normal_(m.weight, 0.0, out_std if name.endswith(("o_proj", "down_proj")) else std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def count_params(cfg: ModelConfig, *, exclude_embeddings: bool = False, active: bool = False) -> int:
    """Parameter count from the config alone (equals `sum(p.numel() for p in Llama(cfg).parameters())`).

    exclude_embeddings=True drops the input embedding table but always counts the output head
    (vocab * dim) once, tied or not: the head is a matmul that costs FLOPs, the lookup is not. This is
    the N of MFU's 6N FLOPs per token, with active=True for MoE: only the top_k experts a token
    uses (plus the router) count.
    """
    D, V, F_, L = cfg.dim, cfg.vocab_size, cfg.ffn_dim, cfg.n_layers
    H, K, hd = cfg.n_heads, cfg.kv_heads, cfg.head_size
    if cfg.mla:  # q (low-rank or not), the latent and shared rope key, their expansion, o
        a = cfg.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (
            D * H * qk
            if a.q_lora_rank is None
            else D * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * H * qk
        )
        attn = q + D * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        attn += a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim * D
    else:
        attn = D * H * hd + 2 * D * K * hd + H * hd * D  # q, k, v, o
    if cfg.qkv_bias:
        attn += H * hd + 2 * K * hd
    if cfg.qk_norm:
        attn += 2 * hd
    dense = 3 * D * F_  # SwiGLU
    n_sparse = 0
    sparse = 0
    if cfg.moe:
        m = cfg.moe
        n_sparse = L - m.dense_layers
        sparse = (
            D * m.n_experts + (m.top_k if active else m.n_experts) * 3 * D * m.ffn_dim
        )  # router + experts
        sparse += 3 * D * m.ffn_dim * m.n_shared_experts  # DeepSeek's always-on experts
    norms = (4 if cfg.post_norms else 2) * D  # two norms a block (four with post_norms)
    embed, head = V * D, (D if cfg.head == "score" else V * D)
    body = L * (attn + norms) + (L - n_sparse) * dense + n_sparse * sparse + D  # + final norm
    if exclude_embeddings:
        return body + head
    return embed + body + (0 if cfg.tie_embeddings and cfg.head == "lm" else head)  # a score head: its own


def build_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, init: bool = True) -> Llama:
    """Build on the meta device (no memory, no wasted init), materialise on `device` in `dtype`, then
    initialise with the caller's torch RNG. init=False leaves the weights uninitialised for a loader."""
    with torch.device("meta"):
        model = Llama(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if init:
        model.init_weights()
    else:
        model.init_buffers()
    return model
