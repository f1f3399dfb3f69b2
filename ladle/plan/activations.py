"""Bytes saved for backward by one micro-batch, from the model's own architecture.

Each term names a tensor ladle's model keeps (ladle/models/llama.py, moe.py) and its size on one
rank: `tokens` rows of a width, in the dtype it has there. Tensor and sequence parallelism
(ladle/parallel/tp.py) split the sequence outside attention and MLP (norms, residuals) and the
heads and FFN columns inside, but the all-gathered input of the q/k/v and gate/up projections is
saved whole; context parallelism splits every sequence. The kernels differ by device, and the
terms follow the kernels ladle calls there:

- RMSNorm: accelerators' fused kernel keeps its input and the 1/rms per row; the CPU's composite
  one also keeps the normalised input. A norm whose input or weight is not fp32 (bf16 weights,
  FSDP's bf16 gather) upcasts first and keeps that fp32 copy and the normalised value too.
- Attention: the flash kernels keep q (after RoPE), k, v, the output and a log-sum-exp per head
  and row; on CPU the output is copied again for o_proj (a (B, H, T, D) layout), and a causal
  call of 128 tokens or more keeps the fp32 mask of its second half (see `sdpa`).
- Under autocast with fp32 parameters (bf16-mixed without FSDP) each forward casts every weight to
  bf16 once, and those copies are saved until backward: `weight_copies`.

Activation checkpointing (ladle/parallel/ac.py): `full` keeps each block's input and recomputes
the block in backward (one block's activations live again then); `selective: N` does that for
every N-th block; `selective: op` keeps the outputs of matmuls and attention and the block input.

Everything is checked against `SavedTensors` in tests/test_plan.py (CPU, within 10%) and on an
accelerator by bench/gpu_plan_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ladle.config.schema import ModelConfig

FP32, I64 = 4, 8


@dataclass(frozen=True)
class Micro:
    """What shapes one micro-batch's activations on one rank."""

    batch: int  # sequences
    seq: int  # tokens per sequence, before context parallelism
    compute: int = 4  # bytes of the compute dtype
    residual: int = 4  # bytes of the residual stream (the embedding's dtype)
    params32: bool = True  # the weights a norm multiplies by are fp32 when they run
    autocast: bool = False
    tp: int = 1
    cp: int = 1
    cpu: bool = False  # the CPU kernels (see the module docstring)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq // self.cp

    @property
    def sp_tokens(self) -> int:
        """Rows of the residual stream on this rank: sequence parallel splits them over tp."""
        return self.tokens // self.tp


def _norm(m: Micro, rows: int, width: int, in_bytes: int, trainable: bool = True) -> int:
    """Saved inside one RMSNorm (not its output: the consumer saves that). The fp32 fast path
    keeps its input and 1/rms (the CPU's composite kernel also the normalised input); the other
    path keeps the fp32 upcast of its input, 1/rms and the normalised value the weight multiplies."""
    if in_bytes == FP32 and m.params32:
        return rows * width * FP32 * (2 if m.cpu else 1) + rows * FP32
    return rows * width * FP32 + rows * FP32 + (rows * width * in_bytes if trainable else 0)


def _norm_out(m: Micro, in_bytes: int) -> int:
    """Bytes per element of a norm's output."""
    if in_bytes == FP32 and m.params32:
        return FP32
    return FP32 if m.params32 else in_bytes  # a bf16 value times an fp32 weight promotes


def block(cfg: ModelConfig, m: Micro, dense: bool = False) -> dict[str, int]:
    """Bytes one transformer block saves for backward, by part; `dense`: one of DeepSeek's first
    `moe.dense_layers` blocks, whose MLP is dense."""
    D = cfg.dim
    n, n_sp, a, r = m.tokens, m.sp_tokens, m.compute, m.residual
    h_bytes = a if m.autocast else _norm_out(m, r)  # the normalised input the projections read
    # attention: input norm, its output (gathered whole under SP), then the attention's own
    attn = _norm(m, n_sp, D, r) + n * D * h_bytes
    attn += latent_attention(cfg, m) if cfg.mla is not None else attention(cfg, m)
    mlp = _norm(m, n_sp, D, r)
    if cfg.moe and not dense:  # token parallel under TP: the layer sees this rank's sequence shard
        mlp += n_sp * D * h_bytes + moe(cfg, m)
    else:
        mlp += n * D * h_bytes + 4 * n * (cfg.ffn_dim // m.tp) * a  # gate, up, silu(gate), their product
    return {"attention": attn, "mlp": mlp}


def attention(cfg: ModelConfig, m: Micro) -> int:
    """Grouped-query attention: q/k/v after RoPE, SDPA's output and log-sum-exp, o_proj's input."""
    hd, n, a = cfg.head_size, m.tokens, m.compute
    H, K = cfg.n_heads // m.tp, cfg.kv_heads // m.tp
    attn = 0
    if cfg.qk_norm:  # q_norm / k_norm on the projections, per head
        attn += _norm(m, n * H, hd, a) + _norm(m, n * K, hd, a)
    T = m.seq // m.cp
    if m.cp > 1:  # all-gathered keys and values: the whole sequence's (ladle/parallel/cp.py)
        attn += n * H * hd * a + m.cp * n * 2 * K * hd * a + n * H * hd * a + n * H * FP32
        attn += T * m.seq * (a if m.cpu else 1)  # the mask over global slots (the CPU's as floats)
    else:
        attn += n * (H + 2 * K) * hd * a + n * H * hd * a + n * H * FP32
    if m.cpu and m.cp == 1 and T >= 128 and T % 2 == 0:  # the CPU's causal attention in two calls (`sdpa`)
        attn += n * H * hd * a  # o_proj's input: the two outputs joined, in (B, T, H, D) order
        attn += (T // 2) * T * a  # the causal mask of the second half, in the compute dtype
        if m.autocast:
            attn += n * K * hd * a // 2  # RoPE's fp32 k cast for each call: the first half twice
    return attn


def latent_attention(cfg: ModelConfig, m: Micro) -> int:
    """DeepSeek-V3's (ladle/models/mla.py): the low-rank projections' norms and outputs, q and k
    joined from their parts, v zero-padded to their width, SDPA's output (that width) and
    log-sum-exp, o_proj's input."""
    ml, n, a = cfg.mla, m.tokens, m.compute
    H = cfg.n_heads // m.tp
    qk, rope, kv_rank = ml.qk_nope_head_dim + ml.qk_rope_head_dim, ml.qk_rope_head_dim, ml.kv_lora_rank
    into = a if m.autocast else _norm_out(m, a)  # what a norm's output is when a matmul reads it
    attn = 0
    if ml.q_lora_rank:
        attn += _norm(m, n, ml.q_lora_rank, a) + n * ml.q_lora_rank * into
    attn += _norm(m, n, kv_rank, a) + n * rope * a  # the norm reads a slice of kv_a's output
    attn += n * kv_rank * into
    v = max(qk, ml.v_head_dim)  # padded (`MLA.attend`)
    attn += 2 * n * H * qk * a + n * H * v * a + n * H * v * a + n * H * FP32
    T = m.seq // m.cp
    if m.cpu and T >= 128 and T % 2 == 0:  # `sdpa`'s two calls, as above
        attn += n * H * ml.v_head_dim * a + (T // 2) * T * a
    return attn


def moe(cfg: ModelConfig, m: Micro) -> int:
    """The router and the experts of one MoE block, on this rank's tokens (its sequence shard
    under TP), and the shared experts (split by TP over the gathered tokens)."""
    e, k, F = cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.ffn_dim
    n, a, D = m.sp_tokens, m.compute, cfg.dim
    shared = 0
    if cfg.moe.n_shared_experts:  # the gathered rows, then gate, up, silu, product
        shared = (m.tokens * D + 4 * m.tokens * (F * cfg.moe.n_shared_experts // m.tp)) * a
    router = 2 * n * e * FP32 + n * FP32  # softmax; z-loss's fp32 logits and log-sum-exp
    router += n * k * I64 + (n * k * FP32 + n * FP32 if cfg.moe.norm_topk_prob else 0)  # top-k
    pairs = n * k
    experts = pairs * I64 + pairs * D * a  # each pair's token, its gathered row
    experts += 4 * pairs * F * a  # gate, up, silu, product per pair
    experts += pairs * I64 + pairs * a + 2 * pairs * D * a  # order, weights, output rows, weighted
    return router + experts + shared


def model(cfg: ModelConfig, m: Micro, first: bool = True, last: bool = True) -> dict[str, int]:
    """Saved outside the blocks: token ids and RoPE tables (first stage), the final norm, head
    input, logits and the loss's per-token values (last stage)."""
    n, n_sp, a, r = m.tokens, m.sp_tokens, m.compute, m.residual
    out = {}
    if first:
        out["embedding"] = n * I64
    out["rope"] = 2 * n * cfg.head_size * r  # cos, sin: shared by every block
    if last:
        h_bytes = a if m.autocast else _norm_out(m, r)
        head = _norm(m, n_sp, cfg.dim, r) + n * cfg.dim * h_bytes
        if cfg.head == "score":
            out["head"] = head + n * a
        else:
            out["head"] = head + n * (cfg.vocab_size // m.tp) * a  # logits, kept by the loss
            out["loss"] = n * (FP32 + I64 + 1)  # log-sum-exp, targets, valid
    return out


def checkpointed_block(cfg: ModelConfig, m: Micro, mode: str, dense: bool = False) -> int:
    """What one checkpointed block keeps: its input, plus (selective op) matmul and attention
    outputs; `dense` as in `block`."""
    keep = m.sp_tokens * cfg.dim * m.residual
    if mode != "op":
        return keep
    D, hd, n, a = cfg.dim, cfg.head_size, m.tokens, m.compute
    H, K = cfg.n_heads // m.tp, cfg.kv_heads // m.tp
    if cfg.mla is not None:  # q_a, q_b, kv_a, kv_b; SDPA (v's padded width); o
        ml = cfg.mla
        qk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
        keep += (
            n * (ml.q_lora_rank or 0) * a + n * H * qk * a + n * (ml.kv_lora_rank + ml.qk_rope_head_dim) * a
        )
        keep += n * H * (ml.qk_nope_head_dim + ml.v_head_dim) * a
        keep += n * H * max(qk, ml.v_head_dim) * a + n * H * FP32 + n * D * a
    else:
        keep += n * (H + 2 * K) * hd * a + n * H * hd * a + n * H * FP32 + n * D * a  # q, k, v; SDPA; o
    if cfg.moe and not dense:
        pairs, e = n * cfg.moe.top_k, cfg.moe.n_experts
        router = e * (FP32 if cfg.moe.scoring == "sigmoid" else a)  # DeepSeek's scores in fp32
        keep += m.sp_tokens * router + 3 * pairs * cfg.moe.ffn_dim * a  # router; gate, up, down
        if cfg.moe.n_shared_experts:  # gate, up; down
            keep += 2 * n * (cfg.moe.ffn_dim * cfg.moe.n_shared_experts // m.tp) * a + n * D * a
    else:
        keep += 2 * n * (cfg.ffn_dim // m.tp) * a + n * D * a  # gate, up; down
    return keep


def weight_copies(cfg: ModelConfig, m: Micro, params: int) -> int:
    """Autocast's bf16 copies of `params` weight elements, saved by the matmuls that read them."""
    return params * m.compute if m.autocast and m.params32 else 0


def saved(cfg: ModelConfig, m: Micro, layers: int, ac: str = "none", every: int = 1, first=True, last=True):
    """{part: bytes} one micro-batch saves for backward on a stage of `layers` blocks; `ac` is
    none, full, selective (every `every`-th block) or op. The part `recompute` is not saved: it is
    the block activations that live again while a checkpointed block runs its backward."""
    whole = sum(block(cfg, m).values())
    # DeepSeek's first `dense_layers` blocks have a dense MLP; they are on the first stage
    dense = min(cfg.moe.dense_layers, layers) if cfg.moe and first else 0
    dense_whole = sum(block(cfg, m, dense=True).values())
    kind = "op" if ac == "op" else "full"
    kept, dense_kept = checkpointed_block(cfg, m, kind), checkpointed_block(cfg, m, kind, dense=True)
    n_ckpt = {"none": 0, "full": layers, "op": layers}.get(ac, (layers + every - 1) // every)
    # selective checkpointing takes every `every`-th block from the first
    ckpt_dense = {"none": 0, "full": dense, "op": dense}.get(ac, (dense + every - 1) // every)
    out = dict(model(cfg, m, first, last))
    if layers - n_ckpt:
        plain_dense = dense - ckpt_dense
        out["blocks"] = (layers - n_ckpt - plain_dense) * whole + plain_dense * dense_whole
    if n_ckpt:
        out["checkpointed blocks"] = (n_ckpt - ckpt_dense) * kept + ckpt_dense * dense_kept
        out["recompute"] = max(whole, dense_whole) if dense else whole
    return out
