"""The config schema: one pydantic model per section, composed into `LadleConfig`.

Every section forbids unknown keys (the loader turns that into a "did you mean" hint) and checks
its own ranges; checks that span sections live in `LadleConfig`. Checks that need the file system
(tokenizer vocabulary, prepared data) live in `ladle.launch.checks`, so this module stays pure.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ladle.units import parse_size


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """Frequency scaling of RoPE, as HF's `rope_scaling` / `rope_parameters`: Llama-3.1's
    (`type: llama3`: factor, low_freq_factor, high_freq_factor) or YaRN (`type: yarn`, DeepSeek-V3's
    long context: factor, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate);
    `original_max_seq_len` is the pretraining context both scale from."""

    type: Literal["llama3", "yarn"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_seq_len: int = Field(8192, ge=1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = Field(None, gt=0)
    truncate: bool = True

    @model_validator(mode="after")
    def _check_factors(self):
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor must be greater than low_freq_factor")
        return self


class MoEConfig(Section):
    """Mixture of experts in every layer's MLP (Mixtral, Qwen3-MoE): a softmax router picks
    `top_k` of `n_experts` SwiGLU experts per token, with no token dropped (see ladle/models/moe.py)."""

    n_experts: int | None = Field(None, ge=2, description="experts per block (required)")
    top_k: int = Field(2, ge=1, description="experts each token is routed to; at most `n_experts`")
    ffn_dim: int | None = Field(
        None,
        ge=1,
        description="SwiGLU hidden size of one expert (required)",
    )
    norm_topk_prob: bool = Field(
        True,
        description="renormalize the top-k router probabilities to sum to 1 (Mixtral always does; Qwen3-MoE's config names it)",
    )
    aux_loss_weight: float = Field(
        0.001,
        ge=0,
        description="weight of the load-balancing loss `n_experts * sum_e f_e * P_e` (Switch/Mixtral form, averaged over layers); 0 turns it off",
    )
    z_loss_weight: float = Field(
        0.0,
        ge=0,
        description="weight of the router z-loss `mean(logsumexp(router logits)^2)` (ST-MoE); 0 turns it off",
    )
    dispatch: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto",
        description="`grouped_mm` (one grouped matmul over tokens sorted by expert), `loop` (one matmul per expert) or `auto` (grouped where this PyTorch and device run it)",
    )
    scoring: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="router scores: `softmax` over the experts (Mixtral, Qwen3-MoE) or an independent `sigmoid` per expert, chosen with the score-correction bias `gate.e_score_correction_bias` (DeepSeek-V3)",
    )
    n_group: int = Field(
        1,
        ge=1,
        description="DeepSeek-V3's group-limited routing: the experts in this many groups, of equal size",
    )
    topk_group: int = Field(
        1,
        ge=1,
        description="the groups a token may use (ranked by the sum of their two best scores); at most `n_group`",
    )
    routed_scaling_factor: float = Field(
        1.0, gt=0, description="the routed experts' weights times this (DeepSeek-V3: 2.5)"
    )
    n_shared_experts: int = Field(
        0,
        ge=0,
        description="always-on experts beside the routed ones, one SwiGLU of `n_shared_experts x ffn_dim` (DeepSeek's `shared_experts`)",
    )
    dense_layers: int = Field(
        0,
        ge=0,
        description="the first this many layers have a dense SwiGLU MLP of `model.ffn_dim` instead (DeepSeek's `first_k_dense_replace`)",
    )
    bias_update_rate: float = Field(
        0.0,
        ge=0,
        description="auxiliary-loss-free balancing (DeepSeek-V3's gamma, 0.001): after each step every expert's correction bias moves up by this when it got fewer tokens than the layer's mean over the global batch, down when more; 0: the bias stays as loaded. Needs `scoring: sigmoid`",
    )
    aux_loss_scope: Literal["batch", "sequence"] = Field(
        "batch",
        description="the load-balancing loss over each micro-batch's tokens, or per sequence and averaged (DeepSeek-V3's complementary sequence-wise loss)",
    )

    @model_validator(mode="after")
    def _check_top_k(self):
        if self.n_experts is not None and self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(
                f"moe.topk_group ({self.topk_group}) must not exceed moe.n_group ({self.n_group})"
            )
        if self.n_experts is not None and self.n_experts % self.n_group:
            raise ValueError(
                f"moe.n_group={self.n_group} does not divide moe.n_experts={self.n_experts} (groups of equal size)"
            )
        if self.bias_update_rate and self.scoring != "sigmoid":
            raise ValueError(
                "moe.bias_update_rate moves the sigmoid router's correction bias: set moe.scoring: sigmoid"
            )
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError(
                "moe.n_group > 1 (group-limited routing) is DeepSeek-V3's: set moe.scoring: sigmoid"
            )
        return self


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one low-rank latent
    per token, queries through their own low-rank projection, and a small decoupled part of each
    head carries RoPE (ladle/models/mla.py)."""

    q_lora_rank: int | None = Field(
        None,
        ge=1,
        description="rank of the query projection (`q_a_proj` -> norm -> `q_b_proj`); null: one `q_proj`",
    )
    kv_lora_rank: int = Field(512, ge=1, description="the latent's size: what the KV cache stores per token")
    qk_nope_head_dim: int = Field(128, ge=1, description="per head: query/key dimensions without RoPE")
    qk_rope_head_dim: int = Field(
        64, ge=2, description="per head: query/key dimensions with RoPE (the key's shared by all heads)"
    )
    v_head_dim: int = Field(128, ge=1, description="per head: value dimensions")


class ModelConfig(Section):
    """A decoder of the Llama family (Llama 2/3, Qwen2 with `qkv_bias`, Qwen3 with `qk_norm`,
    Mistral; sliding-window attention), dense or with a `moe` section (Mixtral, Qwen3-MoE).
    `family` names the Hugging Face architecture it exports as."""

    preset: str | None = Field(
        None,
        description="a bundled model definition whose shape fills the model section (keys set beside it win): `llama-3.2-1b`, `llama-3.2-3b`, `llama-3.1-8b`, `llama-3.1-70b`, `llama-2-70b`, `qwen2.5-0.5b`, `qwen2.5-1.5b`, `qwen2.5-7b`, `qwen3-0.6b`, `qwen3-8b`, `qwen3-32b`, `qwen3-30b-a3b`, `mistral-7b`, `glm-4-9b`, `glm-4-32b-0414`, `mixtral-8x7b`, `deepseek-v3`, `deepseek-v2-lite-class` (files in `ladle/configs/models/`)",
    )
    family: Literal[
        "llama", "qwen2", "qwen3", "mistral", "glm", "glm4", "mixtral", "qwen3_moe", "deepseek_v3"
    ] = Field(
        "llama",
        description="`llama`, `qwen2` (with `qkv_bias`), `qwen3` (with `qk_norm`), `mistral`, `glm` and `glm4` (GLM-4: `qkv_bias`, partial interleaved rotary; `glm4` with `post_norms`), or the mixture-of-experts `mixtral`, `qwen3_moe` and `deepseek_v3` (with `model.moe`; DeepSeek-V3 also `model.mla`): the Hugging Face architecture of `ladle export hf` (docs/training.md)",
    )
    vocab_size: int = Field(32000, ge=1, description="embedding rows; at least the tokenizer's vocabulary")
    dim: int = Field(512, ge=1, description="hidden size")
    n_layers: int = Field(8, ge=1, description="transformer blocks")
    n_heads: int = Field(8, ge=1, description="query heads")
    n_kv_heads: int | None = Field(
        None, ge=1, description="key/value heads (grouped-query attention); null: `n_heads`"
    )
    head_dim: int | None = Field(None, ge=1, description="null: `dim // n_heads` (Qwen3 sets it explicitly)")
    ffn_dim: int = Field(
        1408,
        ge=1,
        description="SwiGLU hidden size (unused when `model.moe` is set: each expert has `model.moe.ffn_dim`)",
    )
    max_seq_len: int = Field(2048, ge=1, description="the longest sequence the model is meant for")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(
        None,
        description="RoPE scaling: `{type: llama3, factor, low_freq_factor, high_freq_factor, original_max_seq_len}` "
        "(Llama 3.1) or `{type: yarn, factor, original_max_seq_len, beta_fast, beta_slow, mscale, mscale_all_dim}` "
        "(DeepSeek-V3)",
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="output head shares the input embedding")
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2)")
    qk_norm: bool = Field(False, description="RMSNorm on q and k per head (Qwen3)")
    partial_rotary_factor: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the share of each head's dimensions RoPE rotates, the first ones (GLM-4: 0.5); the rest pass through",
    )
    rope_interleaved: bool = Field(
        False,
        description="RoPE rotates adjacent pairs (GLM's layout) instead of the two halves (Llama's `rotate_half`)",
    )
    post_norms: bool = Field(
        False,
        description="an RMSNorm on the attention's and the MLP's output before each residual add (GLM-4-0414, `family: glm4`)",
    )
    sliding_window: int | None = Field(
        None,
        ge=1,
        description="sliding-window attention: a query sees this many positions, its own included (Mistral v0.1's 4096, Qwen2's `use_sliding_window`); null: full causal attention",
    )
    max_window_layers: int = Field(
        0,
        ge=0,
        description="with `sliding_window`, the layers below this index attend in full and the rest through the window (Qwen2's `max_window_layers`); 0: every layer",
    )
    init_std: float = Field(
        0.02,
        gt=0,
        description="std of the normal init; output projections get `init_std / sqrt(2 * n_layers)`",
    )
    head: Literal["lm", "score"] = Field(
        "lm",
        description="`lm`: next-token logits; `score`: one scalar per position, a reward model's head (HF's `score.weight`, `...ForSequenceClassification`); `ladle run reward` sets it, and it may differ from `init_from`'s (a causal LM's head is then replaced by a new one)",
    )
    moe: MoEConfig | None = Field(
        None, description="mixture of experts in every layer (after `moe.dense_layers`); None: dense"
    )
    mla: MLAConfig | None = Field(None, description="multi-head latent attention (DeepSeek-V3); None: GQA")
    init_from: str | None = Field(
        None,
        description="a Hugging Face model folder, a ladle checkpoint or a run directory (its latest checkpoint) to start from: its `config.json` (or the checkpoint's model section) fills the model section (keys set in the config must agree, except `max_seq_len`, `init_std` and the run's own `moe.aux_loss_weight`, `moe.z_loss_weight` and `moe.dispatch`), its safetensors (or the checkpoint's model state; not the optimizer or the step) the weights; a resumed run takes its weights from the checkpoint instead",
    )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE rotates (the first ones; all but with partial_rotary_factor;
        MLA's decoupled rope part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_size * self.partial_rotary_factor)

    @model_validator(mode="after")
    def _check_heads(self):
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads}); "
                f"pick n_kv_heads among {[d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]}"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or set head_dim"
            )
        if self.head_size % 2:
            raise ValueError(f"the head size ({self.head_size}) must be even for RoPE")
        if self.rotary_dim % 2:
            raise ValueError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} rotates {self.rotary_dim} of the "
                f"{self.head_size} dimensions of a head; that must be an even number"
            )
        if self.max_window_layers and self.sliding_window is None:
            raise ValueError("model.max_window_layers needs model.sliding_window")
        if self.max_window_layers > self.n_layers:
            raise ValueError(
                f"model.max_window_layers ({self.max_window_layers}) is more than n_layers ({self.n_layers})"
            )
        if self.init_from:  # the checkpoint's config.json gives the family and the experts
            return self
        if self.sliding_window is not None and self.family == "llama":
            raise ValueError(
                "model.sliding_window: Llama has no sliding window in Hugging Face's format; use family "
                "mistral (every layer) or qwen2 (from max_window_layers on)"
            )
        if self.max_window_layers and self.family in ("mistral", "mixtral"):
            raise ValueError(
                f"model.max_window_layers: family {self.family} windows every layer; set it to 0, or use family qwen2"
            )
        moe_family = self.family in ("mixtral", "qwen3_moe", "deepseek_v3")
        if (self.family == "deepseek_v3") != (self.mla is not None):
            raise ValueError("model.mla (multi-head latent attention) and family deepseek_v3 go together")
        if self.moe is not None and self.moe.dense_layers > self.n_layers:
            raise ValueError(
                f"moe.dense_layers ({self.moe.dense_layers}) is more than n_layers ({self.n_layers})"
            )
        if self.moe is not None and (self.moe.n_experts is None or self.moe.ffn_dim is None):
            raise ValueError("model.moe needs n_experts and ffn_dim (or model.init_from, which gives them)")
        if moe_family and self.moe is None:
            raise ValueError(f"family {self.family} is a mixture of experts: add a model.moe section")
        if self.moe is not None and not moe_family:
            raise ValueError(
                f"family {self.family} is dense and cannot hold model.moe; use family mixtral or qwen3_moe"
            )
        return self


class TokenizerConfig(Section):
    path: str = Field(..., description="a folder with a Hugging Face `tokenizer.json`")


class MixSource(Section):
    """One prepared folder of a mixture."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the source's name in metrics (`loss/<name>`), the schedule and events.log",
    )
    path: str = Field(..., description="a folder written by `ladle data prepare` (pretraining text)")
    weight: float = Field(
        ..., gt=0, allow_inf_nan=False, description="its share of the samples, relative to the others'"
    )


class MixStage(Section):
    """New weights of a mixture from a step on (`data.mix_schedule`)."""

    step: int = Field(..., ge=0, description="the first optimizer step (0-based) drawn with these weights")
    weights: dict[str, float] = Field(
        ..., description="source name -> weight (>= 0; a source not named keeps the weight it had)"
    )

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, v):
        bad = {k: w for k, w in v.items() if not 0 <= w < float("inf")}
        if bad:
            raise ValueError(f"weights must be finite and >= 0, got {bad}")
        return v


class DataConfig(Section):
    path: str = Field("", description="a folder written by `ladle data prepare` (or `data.mix` for several)")
    mix: list[MixSource] | None = Field(
        None,
        description="`ladle run pretrain` on several folders in place of `data.path`: `[{name, path, weight}, ...]` (a name of letters, digits, `_.-`; a weight > 0, relative to the others), samples interleaved by weight ([data.md](data.md#mixtures))",
    )
    mix_schedule: list[MixStage] = Field(
        [],
        description="the mixture's weights from given steps on, e.g. `[{step: 900, weights: {web: 0.2, math: 0.8}}]` (annealing)",
    )
    seq_len: int = Field(512, ge=1, description="tokens per training sequence")
    prefetch: int = Field(2, ge=1, description="steps of batches built ahead in a background thread")
    shared_read: bool = Field(
        True,
        description="the ranks of one TP, CP or PP group: the first reads each step's batches and broadcasts them, the others receive (false: each reads its own copy)",
    )
    packing: bool = Field(
        True,
        description="`ladle run sft`: chats packed into rows, each its own document; `false`: one chat per row, padded (docs/finetuning.md)",
    )
    document_mask: bool = Field(
        True,
        description="packed documents attend only to themselves and their RoPE positions restart; `false`: each sample is one causal sequence (needed by `parallel.cp_attention: ring`)",
    )
    verify: Literal["sizes", "checksums"] = Field(
        "sizes",
        description="before training, every file `meta.json` lists must be there with the size it was written with, and each shard must agree with its index (a missing, truncated or mismatched file is named with its offset); `checksums`: also each file's sha256 (reads all the data once; a damaged shard is named with its first bad token's offset)",
    )

    @model_validator(mode="after")
    def _check_mix(self):
        if self.mix is None:
            if not self.path:
                raise ValueError("set data.path (a prepared folder) or data.mix (several)")
            if self.mix_schedule:
                raise ValueError("data.mix_schedule changes the weights of data.mix, which is not set")
            return self
        if self.path:
            raise ValueError("set data.path or data.mix, not both (a mix names each folder's path)")
        if not self.mix:
            raise ValueError("data.mix is empty; name at least one source")
        names = [s.name for s in self.mix]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"data.mix names {', '.join(twice)} more than once; give each source its own name"
            )
        steps = [st.step for st in self.mix_schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"data.mix_schedule's steps must increase, got {steps}")
        weights = {s.name: s.weight for s in self.mix}
        for i, st in enumerate(self.mix_schedule):
            unknown = sorted(set(st.weights) - set(names))
            if unknown:
                raise ValueError(
                    f"data.mix_schedule[{i}] names {', '.join(unknown)}, not a source of data.mix "
                    f"({', '.join(names)})"
                )
            weights.update(st.weights)
            if not sum(weights.values()) > 0:
                raise ValueError(f"data.mix_schedule[{i}] (step {st.step}) leaves every weight at 0")
        return self


class OptimConfig(Section):
    name: Literal["adamw", "muon"] = Field(
        "adamw",
        description="the optimizer: `adamw` (decoupled weight decay), or `muon` (Newton-Schulz orthogonalised momentum for the blocks' matrices, AdamW for the rest; docs/training.md)",
    )
    lr: float = Field(3e-4, gt=0, description="peak learning rate (Muon's too, by `muon_adjust_lr`)")
    weight_decay: float = Field(0.1, ge=0, description="applied to weight matrices only")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="AdamW's decay rates of the first and second moments"
    )
    eps: float = Field(1e-8, gt=0, description="AdamW's term added to the root of the second moment")
    decay_norms_biases_embeddings: bool = Field(False, description="also decay norms, biases and embeddings")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        "auto",
        description="`fused` (CUDA, CPU), `foreach` (elsewhere), or force `fused`/`foreach`/`for-loop`",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon: the momentum buffer's decay")
    muon_nesterov: bool = Field(
        True, description="Muon: orthogonalise the Nesterov update g + momentum x buffer"
    )
    muon_ns_steps: int = Field(
        5, ge=1, description="Muon: Newton-Schulz iterations (quintic, Keller Jordan's)"
    )
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Muon: the Newton-Schulz iteration's dtype; `auto`: bfloat16 where the run computes in bf16 (`precision.mode` bf16-mixed or bf16), else float32",
    )
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description="Muon: the update's scale; `match_rms_adamw` (Moonlight): lr x 0.2 x sqrt(max(rows, cols)), so AdamW's lr and weight decay carry over; `original` (Keller Jordan's): lr x sqrt(max(1, rows / cols))",
    )

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, v):
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class SchedulerConfig(Section):
    name: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="`cosine`, `linear`, `constant` or `wsd` (warmup-stable-decay)"
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from `lr / warmup_steps` to `lr`")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="the final lr of cosine, linear and wsd, as a fraction of `optim.lr`"
    )
    decay_ratio: float = Field(
        0.2, gt=0, le=1, description="wsd: the fraction of post-warmup steps spent decaying (linearly)"
    )


class TrainConfig(Section):
    max_steps: int = Field(1000, ge=1, description="optimizer steps; the schedule spans them")
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward pass per rank")
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="microbatches per optimizer step; global batch = micro x accum x data-parallel ranks",
    )
    grad_clip: float = Field(
        1.0, ge=0, description="global gradient-norm clip; 0 disables (the norm is still logged)"
    )
    log_every: int = Field(10, ge=1, description="steps between console lines and `metrics.jsonl` records")
    eval_every: int = Field(0, ge=0, description="steps between validations; 0: only at the end")
    eval_steps: int = Field(
        10,
        ge=0,
        description="validation batches per evaluation; 0 disables validation (RL recipes: batches of held-out prompts, their rewards)",
    )
    eval_at_start: bool = Field(
        False,
        description="validate once before the first step too: the baseline of the run (verl's val_before_train)",
    )
    resume: str = Field(
        "never",
        description="`never` (refuse an output_dir holding a run), `auto` (continue from `checkpoints/latest`, or start fresh), or the path of a checkpoint",
    )
    exit_at_step: int = Field(
        0, ge=0, description="stop with a checkpoint at this step, keeping the `max_steps` schedule (0: off)"
    )
    exit_after_minutes: float = Field(
        0,
        ge=0,
        description="stop with a checkpoint after this wall time, e.g. before a job's time limit (0: off)",
    )
    device: str = Field(
        "auto", description="`auto` (CUDA, then NPU, then CPU), `cpu`, `cuda`, `npu`, optionally `:index`"
    )
    allow_data_change: bool = Field(
        False,
        description="resume although the tokenizer or the prepared data differ from those the checkpoint was trained on (each checkpoint records their hashes); otherwise such a resume is refused naming what changed",
    )
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 leaves torch's default")
    compile: bool = Field(
        False,
        description="`torch.compile` each transformer block (inductor, on CPU and CUDA; needs a C++ compiler on CPU). Norms, RoPE, SwiGLU and casts fuse; attention and the KV cache stay eager (attention is compiled too under `parallel.tp > 1`, docs/training.md). The first step and the first validation pay the compile time (~15 s for bench-30m on 2 cores), then bench-30m trains 5-8% faster on CPU (docs/performance.md).",
    )


class PrecisionConfig(Section):
    mode: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16"] = Field(
        "bf16-mixed",
        description="`fp32`, `bf16-mixed`, `fp16-mixed` (dynamic loss scaling), `bf16` (pure bf16) or `auto` (bf16-mixed where the device computes bf16 natively, else fp16-mixed on a GPU or fp32 on a CPU; [training.md](training.md#precision))",
    )
    init_loss_scale: float = Field(2.0**16, gt=0, description="fp16-mixed: the first loss scale")
    loss_scale_window: int = Field(
        1000, ge=1, description="fp16-mixed: steps without overflow before the scale doubles"
    )


class CheckpointConfig(Section):
    every: int = Field(
        0, ge=0, description="steps between checkpoints; one is always saved at the end (0: only then)"
    )
    keep_last: int = Field(
        2, ge=1, description="complete checkpoints kept; older ones are removed after a newer one is complete"
    )
    async_save: bool = Field(
        False, description="write through DCP's async save: the loop stalls only for the staging copy"
    )


class ParallelConfig(Section):
    """The parallel layout over all processes (ladle/parallel/mesh.py): their product is the world
    size. Checked against the world and the model before any process starts."""

    dp_replicate: int = Field(
        1,
        ge=1,
        description='data-parallel replicas: plain DDP when it is the only degree, HSDP\'s replicate dimension beside `dp_shard` (docs/training.md, "Parallel layouts")',
    )
    dp_shard: int = Field(
        -1,
        ge=-1,
        description="FSDP2 shards over data-parallel ranks; -1: the world size divided by the other degrees",
    )
    tp: int = Field(
        1,
        ge=1,
        description="tensor parallel with sequence parallel and a vocab-sharded loss; divides `n_heads`, `n_kv_heads`, `ffn_dim`, `vocab_size` and `data.seq_len`; tied embeddings too (the head reuses the vocabulary-sharded embedding); an MoE layer runs token parallel (each rank routes its sequence shard through the whole experts; shared experts split); not yet with `ep`",
    )
    pp: int = Field(
        1,
        ge=1,
        description="pipeline parallel ranks (`torch.distributed.pipelining`); the step's `train.grad_accum_steps` microbatches (at least `pp`) are the pipeline's (MoE: each stage adds its router losses); not with tied embeddings yet",
    )
    cp: int = Field(
        1,
        ge=1,
        description="context parallel: each sample's tokens split over `cp` ranks, load-balanced (`2 * cp` divides `data.seq_len`); not with `pp` or `ep` yet",
    )
    cp_attention: Literal["allgather", "ring"] = Field(
        "allgather",
        description="`allgather`: keys and values all-gathered over the CP group, document masks kept, any device; `ring`: PyTorch's ring attention, CUDA only, needs `data.document_mask: false`",
    )
    async_tp: bool = Field(
        False,
        description="tensor parallel: inductor's micro-pipelining overlaps each all-gather and reduce-scatter with its matmul over symmetric memory (torchtitan's async TP). Needs `tp > 1`, `train.compile: true` and CUDA; refused otherwise before launch. Not yet run on a GPU here",
    )
    ep: int = Field(
        1,
        ge=1,
        description="expert parallel for MoE models: the experts split over `ep` of the `dp_shard` ranks, tokens exchanged by all-to-all; divides `moe.n_experts` and `dp_shard`",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = Field(
        "1f1b",
        description="`gpipe`, `1f1b`, `interleaved_1f1b`, `interleaved_zb` (interleaved zero bubble) or `zbv` (zero bubble, V-shaped); the last three put two stages on each rank",
    )
    pp_split: list[int] | None = Field(
        None,
        description="layer indices where stages 1, 2, ... begin (one fewer than the stages); null: as even as can be",
    )
    reshard_after_forward: bool = Field(
        True,
        description="FSDP: free each block's gathered weights after its forward and gather again in backward (false: keep them, less communication, more memory)",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP: sharded weights, gradients and optimizer state live in host memory (FSDP2's `CPUOffloadPolicy`)",
    )
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="FSDP under `bf16-mixed`: dtype of the gradient reduce-scatter (the gathered weights are bf16)",
    )

    @field_validator("dp_shard")
    @classmethod
    def _not_zero(cls, v):
        if v == 0:
            raise ValueError("must be -1 (the rest of the world) or at least 1")
        return v


class ActivationCheckpointConfig(Section):
    """Trading recomputation for activation memory (ladle/parallel/ac.py)."""

    mode: Literal["none", "full", "selective"] = Field(
        "none",
        description="`full`: every block's forward runs again in backward, only its input kept; `selective`: see below (docs/training.md)",
    )
    selective: Literal["op"] | int = Field(
        "op",
        description="`op`: keep the outputs of matmuls and attention, recompute the cheap ops (norms, RoPE, SiLU, casts); an integer N: checkpoint every N-th block fully",
    )
    offload: bool = Field(
        False,
        description="move what is saved for backward to pinned host memory (accelerators; no effect on a CPU)",
    )

    @field_validator("selective")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("a block interval must be at least 1 (or 'op')")
        return v


class SampleConfig(Section):
    """A generated sample printed at the end of a run (the demo's "does it write Python?")."""

    prompt: str = Field(
        "", description="after a completed run, print a continuation of this prompt (empty: none)"
    )
    max_new_tokens: int = Field(64, ge=0, description="tokens of the sample's continuation at most")
    temperature: float = Field(0.8, ge=0, description="0: greedy")
    top_k: int = Field(50, ge=0, description="0: no top-k filter")


class EvalConfig(Section):
    """Downstream evaluation during training with lm-evaluation-harness (the extra `ladle[eval]`):
    rank 0 gathers the whole weights and scores its tasks while the other ranks wait
    (docs/evaluation.md)."""

    harness: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks (or groups) by name, from its registry or "
        "`harness_include_path`; checked before launch; empty: none",
    )
    harness_every: int = Field(
        0,
        ge=0,
        description="run them every this many steps, and at the end of a completed run; 0: at the end only",
    )
    harness_include_path: str | None = Field(
        None, description="a folder of your own task YAMLs (local data files), as lm-eval's --include_path"
    )
    harness_limit: int | None = Field(None, ge=1, description="the first N documents of each task; null: all")
    harness_num_fewshot: int | None = Field(None, ge=0, description="null: each task's own")
    harness_batch_size: int = Field(8, ge=1, description="requests per forward pass")


class LoRAConfig(Section):
    """Low-rank adapters (ladle/models/lora.py): the base model frozen, only the adapters trained,
    checkpointed and exported (PEFT's format), or merged into the base for export."""

    rank: int = Field(8, ge=1, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, description="scaling alpha / r (alpha / sqrt(r) with `rslora`)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="linear modules to adapt, by name (`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`); each must exist",
    )
    rslora: bool = Field(False, description="rank-stabilised scaling")
    dora: bool = Field(False, description="DoRA: a learned magnitude per output row")
    modules_to_save: list[Literal["embed_tokens", "lm_head"]] = Field(
        [],
        description="`embed_tokens` and/or `lm_head`, trained in full beside the adapters (PEFT's modules_to_save): for tokens the base never learned; with tied embeddings either name trains the one matrix; not also a target",
    )
    quantize_base: Literal["none", "nf4"] = Field(
        "none",
        description="`nf4`: QLoRA, the frozen base's block linears in 4-bit NF4, dequantized per layer (one device or DDP)",
    )

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, v):
        if not v:
            raise ValueError("name at least one linear module to adapt (e.g. [q_proj, v_proj])")
        return v

    @model_validator(mode="after")
    def _saved_not_adapted(self):
        both = sorted(set(self.targets) & set(self.modules_to_save))
        if both:
            raise ValueError(
                f"lora: {both[0]!r} is in both targets and modules_to_save; a module gets an adapter "
                "or is trained in full, not both"
            )
        return self


DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


class DPOConfig(Section):
    """Direct preference optimisation and its family (`ladle run dpo`, ladle/preference/losses.py)."""

    loss: Literal[DPO_LOSSES] = Field(
        "sigmoid",
        description="`sigmoid` (DPO), `ipo`, `hinge`, `robust`, `simpo` (docs/alignment.md); another name is refused with the list",
    )
    beta: float = Field(0.1, gt=0, description="the KL strength beta (IPO's tau)")
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="in [0, 0.5): cDPO for `sigmoid`, rDPO for `robust`, also SimPO's",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target margin")
    rpo_alpha: float = Field(
        0.0, ge=0, description="weight of an added NLL term on the chosen completions (RPO)"
    )
    reference: Literal["cached", "online"] = Field(
        "cached",
        description="`cached`: reference log-probs computed once, stored in `OUTPUT_DIR/reference/` keyed by a hash of data and reference, reused on resume, refused when made from other inputs; `online`: a frozen reference model beside the policy (with LoRA: the adapters switched off); not with `simpo`",
    )

    @model_validator(mode="after")
    def _simpo_has_no_reference(self):
        if self.loss == "simpo" and "reference" in self.model_fields_set and self.reference == "online":
            raise ValueError(
                "dpo.loss=simpo is reference-free: it has no reference model to run online; remove dpo.reference"
            )
        return self


class RewardConfig(Section):
    """A reward model's Bradley-Terry loss (`ladle run reward`)."""

    margin: float = Field(0.0, description="Bradley-Terry margin m: -log sigmoid(r_chosen - r_rejected - m)")
    center_coef: float = Field(
        0.0, ge=0, description="weight of mean((r_chosen + r_rejected)^2) (trl's center_rewards_coefficient)"
    )


class EnvConfig(Section):
    """Multi-turn episodes with tools and an environment (ladle/rl/env.py, docs/rl.md)."""

    file: str | None = Field(
        None,
        description="a Python file of yours defining the environment class and the tool functions, imported because you name it",
    )
    name: str | None = Field(
        None,
        description="the environment class in `file`: `reset(record) -> messages`, `step(reply) -> {messages, reward, done}`, one instance per episode; null: the record's prompt and the tools alone (a turn without tool calls is the answer)",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment class"
    )
    tools: list[str] = Field(
        default_factory=list,
        description="functions of `file` offered as tools (type hints and a Google-style docstring make their schema), or `python` (programs run in ladle's sandbox)",
    )
    tool_format: Literal["auto", "hermes", "llama3", "glm4"] = Field(
        "auto",
        description="how the model calls tools: `auto` reads it from the chat template (Qwen's <tool_call> is `hermes`, Llama-3.1's JSON `llama3`, GLM-4's `glm4`)",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="each tool call's time limit (and the `python` tool's)"
    )
    max_turns: int = Field(4, ge=1, description="the model's replies in an episode at most")
    max_total_tokens: int = Field(
        0,
        ge=0,
        description="an episode's tokens at most (prompt, replies and the messages between); 0: `data.seq_len`",
    )

    @model_validator(mode="after")
    def _needs_file(self):
        if self.name is not None and self.file is None:
            raise ValueError(f"name {self.name!r} needs `file`, the Python file that defines it")
        if self.name is None and not self.tools:
            raise ValueError("name an environment class (`name`) or tools (`tools`), or remove the section")
        own = [t for t in self.tools if t != "python"]
        if own and self.file is None:
            raise ValueError(f"tools {own} need `file`, the Python file that defines them")
        return self


class RolloutConfig(Section):
    """How the RL recipes sample their responses (ladle/rl/rollout.py)."""

    temperature: float = Field(
        1.0, gt=0, description="sampling temperature (the log-probs of the loss are of softmax(logits / T))"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, description="0: no top-k filter")
    max_response_len: int = Field(
        256, ge=1, description="response tokens at most; `data.seq_len` holds prompt + response"
    )
    stop: list[str] = Field(default_factory=list, description="strings that end a response")
    rollout_batch: int = Field(64, ge=1, description="rows per generation batch (ladle's engine)")
    engine: Literal["ladle", "vllm"] = Field(
        "ladle",
        description="what generates the rollouts: `ladle` (the training model itself, as laid out) or `vllm` (vLLM in each training process, or on the engine ranks of GRPO's `placement: separated`, the policy's weights streamed to it after every update; the extra `ladle[vllm]`); docs/rl.md",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM's engine arguments (`gpu_memory_utilization`, `enforce_eager`, `max_num_seqs`, `enable_sleep_mode`, ...), checked against vLLM's before launch",
    )
    balance: bool = Field(
        True,
        description="with several data-parallel ranks: before generation, each step's prompts are dealt out over the ranks by their expected tokens; after it, whole groups move between ranks so each trains on about as many tokens (logged: `rollout_imbalance`, `train_imbalance`)",
    )
    micro_tokens: int = Field(
        0,
        ge=0,
        description="training microbatches of at most this many padded tokens (rows x the longest), whole groups, shortest first so rows of like length pad together (verl's dynamic batch size); every rank runs as many; 0: one pass per prompt microbatch",
    )
    offload_idle: bool = Field(
        True,
        description="shared placement: on an accelerator, the models a phase does not use wait in host memory (the reference and reward model while generating and training, the critic and its optimizer state while generating); every model stays on every rank",
    )
    rollout_correction: Literal["none", "tis", "mis"] = Field(
        "none",
        description="for the sampler/trainer mismatch (another engine, precision, stale weights): `tis` weights each token's policy loss by min(p_train / p_sample, cap), `mis` masks tokens (or responses) whose ratio is outside [1/cap, cap]; `rollout_kl` is logged either way (docs/rl.md)",
    )
    rollout_correction_level: Literal["token", "sequence"] = Field(
        "token",
        description="the ratio per `token`, or per response (`sequence`: the product over its tokens)",
    )
    rollout_correction_cap: float = Field(2.0, gt=1, description="the cap of `rollout_correction` (above 1)")
    log_rollouts: int = Field(
        0,
        ge=0,
        description="write this many sampled episodes a rollout batch to `rollouts.jsonl` in the run directory (rank 0's first): step, messages, the token ids as trained, the loss mask, each reward term; `ladle report` shows the last few",
    )
    routing_replay: bool = Field(
        False,
        description="MoE policies: the training forward routes each token to the experts its sampler chose (R3), so the ratio compares the same computation; `routing_agreement` (the share of tokens the trainer routes as the sampler did) is logged either way (either engine, not under TP; docs/rl.md)",
    )
    env: EnvConfig | None = Field(
        None,
        description="multi-turn episodes: an environment of yours and/or tools; the model's turns are trained, the messages between them are context (docs/rl.md)",
    )


class GRPOConfig(RolloutConfig):
    """Group relative policy optimisation on the policy's own rollouts (`ladle run grpo`,
    ladle/rl/algorithms.py, docs/rl.md)."""

    num_samples: int = Field(
        8,
        ge=1,
        description="responses sampled per prompt (the group); 1 only with `scale: batch` or `none` and `advantage: grpo`",
    )
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo",
        description="`grpo` (r - group mean), `rloo` (leave-one-out), `reinforce_pp` (whitened over the batch); docs/rl.md",
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's or the `batch`'s std; `none`: Dr. GRPO"
    )
    kl_coef: float = Field(
        0.0, ge=0, description="weight of the KL to the reference; 0 keeps no reference model"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="`k1`, `k2`, `k3` (Schulman's estimators)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="`token-mean` (DAPO), `seq-mean-token-mean` (GRPO), `seq-mean-token-sum-norm` (Dr. GRPO)",
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratios below 1 - clip_low are clipped")
    clip_high: float = Field(
        0.2, ge=0, description="ratios above 1 + clip_high are clipped (DAPO's clip-higher: 0.28)"
    )
    importance: Literal["token", "sequence"] = Field(
        "token", description="`token`, or `sequence` (GSPO: one weight per response)"
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="optimizer steps per rollout batch, on its old log-probs; `checkpoint.every` must be a multiple",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the entropy bonus (the loss minus coef x the mean entropy of the response tokens); `entropy` is logged either way",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: groups whose rewards are all equal are dropped and the step refills from the next prompts (docs/rl.md)",
    )
    max_sampling_rounds: int = Field(
        3,
        ge=1,
        description="rounds of sampling a step may take to refill; then it trains on the groups it found",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: responses cut by `max_response_len` stay out of the loss",
    )
    placement: Literal["shared", "separated"] = Field(
        "shared",
        description="`shared`: the policy generates where it trains; `separated`: half the ranks hold a copy of the policy that only generates (the engine), laid out by `parallel.*` like the trainer's half, its weights sent rank to rank after each update (docs/rl.md)",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="asynchronous training (`placement: separated`): the engine generates the batches of the next steps while the trainer trains, from weights at most this many updates older than those of the batch's first step (its further `num_iterations` steps add their own, as in the synchronous loop; logged: `staleness_mean`, `staleness_max`); 0: the synchronous loop",
    )

    @model_validator(mode="after")
    def _groups(self):
        if self.num_samples == 1 and (self.scale == "group" or self.advantage != "grpo"):
            raise ValueError(
                "grpo.num_samples=1 leaves a group of one: its advantage is always 0 with "
                f"{'grpo.scale=group' if self.scale == 'group' else f'grpo.advantage={self.advantage}'}; "
                "sample at least 2 per prompt"
            )
        if self.num_samples == 1 and self.dynamic_sampling:
            raise ValueError(
                "grpo.dynamic_sampling keeps groups whose rewards differ: grpo.num_samples=1 has none; "
                "sample at least 2 per prompt"
            )
        if self.max_staleness and self.placement != "separated":
            raise ValueError(
                f"grpo.max_staleness={self.max_staleness} generates while the trainer trains, which needs "
                "engine ranks of their own: set grpo.placement: separated (or max_staleness: 0)"
            )
        if self.placement == "separated" and self.dynamic_sampling:
            raise ValueError(
                "grpo.dynamic_sampling with grpo.placement=separated: DAPO's refill samples more prompts "
                "while the step is made, and the separated engine generates whole batches ahead; use "
                "grpo.placement: shared for dynamic sampling"
            )
        return self


class PPOConfig(RolloutConfig):
    """Proximal policy optimisation with a value model (`ladle run ppo`, ladle/rl/advantages.py,
    docs/rl.md)."""

    num_samples: int = Field(1, ge=1, description="responses sampled per prompt")
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="weight of the per-token KL to the reference in the reward (-kl_coef KL on every token); 0 keeps no reference model",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="`k1`, `k2`, `k3` for that KL")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    whiten_advantages: bool = Field(
        True,
        description="advantages whitened over every response token of the rollout batch, all ranks together",
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratios below 1 - clip_low are clipped")
    clip_high: float = Field(0.2, ge=0, description="ratios above 1 + clip_high are clipped")
    dual_clip: float = Field(
        0.0, ge=0, description="c > 1: a negative advantage's loss is capped at -c A (dual-clip PPO); 0: off"
    )
    value_clip: float = Field(
        0.2,
        ge=0,
        description="the critic's values move at most this far from the rollout's in its loss; 0: unclipped",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="weight of the entropy bonus; `entropy` is logged either way"
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    minibatches: int = Field(
        1,
        ge=1,
        description="optimizer steps per pass (each on a share of the step's microbatches); must divide `train.grad_accum_steps`; `checkpoint.every` must be a multiple of `ppo_epochs x minibatches`",
    )
    critic_init: str | None = Field(
        None,
        description="the critic's start: a reward model (run dir, checkpoint, HF folder) or any decoder of the policy's vocabulary (a new value head then); null: `rewards.model` if set, else the policy's `model.init_from`",
    )
    critic_lr: float | None = Field(
        None,
        gt=0,
        description="the critic's learning rate (its optimizer, schedule and clipping are otherwise the run's); null: `optim.lr`",
    )
    normalize_rewards: bool = Field(
        True,
        description="each score standardised by the running mean and std of every score so far (checkpointed), before the KL penalty: the critic's targets keep one scale whatever the reward model's offset and spread (OpenRLHF's normalize_reward)",
    )
    value_head: Literal["zero", "keep"] = Field(
        "zero",
        description="the critic's value head at the start: `zero` (every value 0, the running mean of the normalised rewards, so the first advantages are the rewards themselves), or `keep` the head of `critic_init` (a reward model's score head judges whole responses, and its scores of partial ones mislead GAE)",
    )
    critic_warmup: int = Field(
        0,
        ge=0,
        description="the first steps train the critic alone: the actor's update waits until the values fit (verl's critic_warmup)",
    )
    placement: Literal["shared", "separated"] = Field(
        "shared",
        description="`shared`: every model on every rank (idle ones in host memory: `offload_idle`); `separated`: the actor and reference on half the ranks, the critic and reward model on the other half, each half laid out by `parallel.*` (so twice its ranks are needed; docs/rl.md)",
    )

    @model_validator(mode="after")
    def _dual_clip(self):
        if 0 < self.dual_clip <= 1:
            raise ValueError(f"ppo.dual_clip={self.dual_clip}: must be above 1 (or 0: off)")
        return self


class DistillConfig(RolloutConfig):
    """On-policy distillation (`ladle run distill`, docs/rl.md): the student samples responses, a
    frozen teacher scores every token of them, and the student moves toward the teacher's
    next-token distribution at each."""

    teacher: str | None = Field(
        None,
        description="the teacher: a ladle run dir or checkpoint, or a Hugging Face folder, of the student's tokenizer (any size; frozen, laid out by `parallel.*` like the student)",
    )
    teacher_preset: str | None = Field(
        None,
        description="the teacher's shape by a bundled model name (`qwen2.5-7b`), for `ladle plan` where the teacher's folder is not at hand; a run takes the shape from the teacher itself",
    )
    loss: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        "reverse_kl",
        description="the divergence at each response token, over the whole vocabulary: `reverse_kl` KL(student||teacher) (on-policy distillation's), `forward_kl` KL(teacher||student), `jsd` GKD's generalised Jensen-Shannon with `beta`",
    )
    beta: float = Field(0.5, gt=0, lt=1, description="`jsd`'s mixture: beta x teacher + (1 - beta) x student")
    num_samples: int = Field(1, ge=1, description="responses sampled per prompt")
    reward_weight: float = Field(
        0.0,
        ge=0,
        description="with > 0 the rewards (`rewards.terms`) join: REINFORCE on the sampled tokens with each reward minus its prompt group's mean, times this weight (`num_samples` >= 2); the rewards are logged either way",
    )

    @model_validator(mode="after")
    def _groups(self):
        if self.reward_weight > 0 and self.num_samples < 2:
            raise ValueError(
                f"distill.reward_weight={self.reward_weight} compares each reward with its prompt group's mean: "
                "sample at least 2 per prompt (distill.num_samples)"
            )
        return self


class RewardsConfig(Section):
    """The rewards of the RL recipes (ladle/rl/rewards.py): weighted terms by name."""

    terms: list[dict] = Field(
        default_factory=lambda: [{"name": "exact"}],
        description="the RL rewards, summed with their `weight`, each logged as `reward_<key>_mean`: `exact`, `regex`, `math`, `format`, `length` or a function of `rewards.file`, with their options (docs/rl.md)",
    )
    file: str | None = Field(
        None, description="a Python file of your own reward functions, imported because you name it"
    )
    model: str | None = Field(
        None,
        description="a reward model (`ladle run reward` run dir, checkpoint, or HF `...ForSequenceClassification` folder) of the policy's vocabulary: its score of each whole response (at its last token) joins the sum, logged as `reward_model_mean`; with it `rewards.terms` may be `[]`",
    )
    model_weight: float = Field(1.0, description="the reward model's weight in the sum")
    on_error: Literal["stop", "zero"] = Field(
        "stop",
        description="a reward term that raises: `stop` the run (exit 2, naming the term, its file and line, the exception, the step, prompt and sample; the checkpoints so far kept) or score it `zero` and go on (counted as `reward_errors`, the first cases named in events.log); a sandboxed program's own failure is never an error, it scores 0",
    )


class GuardConfig(Section):
    """What a bad step does (ladle/train/guard.py): a non-finite loss or gradient norm is always
    skipped; a spike (the loss or the gradient norm far above its recent mean) is logged, and
    skipped with `skip_spikes`; too many skips in a row roll the run back or stop it."""

    z_threshold: float = Field(
        6.0,
        ge=0,
        description="a loss or gradient norm this many standard deviations above its mean over the window is a **spike** (an event naming the batch's samples); 0: no spike detection",
    )
    window: int = Field(
        100,
        ge=2,
        description="the accepted steps (finite, not skipped) the mean and deviation of the loss and gradient norm are taken over",
    )
    min_history: int = Field(
        20,
        ge=2,
        description="no spike is called before the window holds this many steps",
    )
    skip_spikes: bool = Field(
        False,
        description="skip a spike's update (a non-finite step's is always skipped); else it is logged and applied",
    )
    max_skips: int = Field(
        3,
        ge=1,
        description="skipped steps in a row before `on_max_skips` (was `train.max_bad_steps`)",
    )
    on_max_skips: Literal["rollback", "stop"] = Field(
        "rollback",
        description="`rollback`: reload the last checkpoint (weights, optimizer, schedule) and go on past the data read since; the run stops instead when there is none or after `max_rollbacks`. `stop`: stop with the report",
    )
    rollback_lr_factor: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the learning rate is multiplied by this at each rollback (e.g. 0.5), and stays so in later checkpoints",
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks in one run before it stops instead")

    @model_validator(mode="after")
    def _window(self):
        if self.min_history > self.window:
            raise ValueError(f"guard.min_history ({self.min_history}) exceeds guard.window ({self.window})")
        return self


class DeviceConfig(Section):
    """The accelerator's own settings (ladle/device.py)."""

    alloc_conf: str = Field(
        "",
        description="the caching allocator's settings, e.g. `expandable_segments:True` (less fragmentation), applied as `PYTORCH_CUDA_ALLOC_CONF` on CUDA or `PYTORCH_NPU_ALLOC_CONF` on an NPU before the first allocation; empty: as the environment says",
    )
    memory: str | None = Field(
        None,
        description="one device's memory (`80GB`, `64GiB`, `80g`) for the check before launch; null: what the accelerator reports (a CPU run is not checked unless this is set)",
    )
    memory_check: bool = Field(
        True,
        description="refuse a run whose planned memory (`ladle plan`) exceeds the device's before anything starts; `ladle run --no-memory-check` sets it false",
    )

    @field_validator("memory")
    @classmethod
    def _size(cls, v):
        if v is not None:
            try:
                parse_size(v, "device.memory")
            except Exception as e:
                raise ValueError(str(e)) from None
        return v


class ProfilerConfig(Section):
    """Profiled steps and the loop's performance warnings (ladle/train/profile.py)."""

    enabled: bool = Field(
        False,
        description="record steps `start_step` .. `start_step + steps - 1` with torch.profiler (torch_npu's on an NPU): traces in `OUTPUT_DIR/profile/` for Perfetto or TensorBoard, and the step time by category (compute, exposed and overlapped communication, data wait, optimizer, host overhead) in events.log and run_card.json",
    )
    start_step: int = Field(5, ge=1, description="the first profiled step (after warm-up and compilation)")
    steps: int = Field(3, ge=1, description="how many steps are profiled")
    data_wait_warn: float = Field(
        0.2,
        gt=0,
        le=1,
        description="warn once in events.log when data wait passes this share of the step time",
    )
    mfu_floor: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="on an accelerator, warn once when MFU stays under this for `patience` logged windows; 0: off",
    )
    patience: int = Field(3, ge=1, description="logged windows in a row under `mfu_floor` before the warning")


class LoggersConfig(Section):
    """Metric loggers beside metrics.jsonl (ladle/train/loggers.py), each an optional extra."""

    tensorboard: bool = Field(
        False,
        description="TensorBoard event files in `OUTPUT_DIR/tensorboard/` (`pip install 'ladle[tensorboard]'`)",
    )
    wandb: bool = Field(False, description="a Weights & Biases run (`pip install 'ladle[wandb]'`)")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: files under `OUTPUT_DIR/wandb/`, no network (`wandb sync` uploads them); online: streamed",
    )
    wandb_project: str = Field("ladle", description="the W&B project")
    wandb_name: str | None = Field(None, description="the W&B run's name; null: the output directory's name")


class DistConfig(Section):
    """The process group (ladle/distributed.py)."""

    timeout_s: float = Field(
        600.0,
        gt=0,
        description="a collective that waits longer fails on every rank (the error names it) instead of hanging",
    )


class WatchdogConfig(Section):
    """The hang watchdog (ladle/watchdog.py): a rank stuck in one phase is reported, every rank's
    stacks are dumped, and the job exits with status 3 so that the launcher restarts it."""

    timeout_s: float = Field(
        300.0,
        ge=0,
        description="a rank whose phase (data, forward, backward, optimizer, a named collective, checkpoint, validation, generation) has not changed for this long is hung: the report names every rank's phase and the suspect, every rank dumps its Python stacks to `OUTPUT_DIR/hang/`, and the job exits with status 3 for the launcher to restart; must be below `dist.timeout_s`, which applies until the first step is done; 0: off",
    )


class FaultsConfig(Section):
    """Faults injected on purpose, to rehearse recovery and to test it (ladle/faults.py);
    each switch is refused unless `enabled`. Steps count from 1; 0 is off. A job's restarted
    attempt is not hit (torchrun's TORCHELASTIC_RESTART_COUNT > 0), so it trains past the step."""

    enabled: bool = Field(
        False,
        description="allow the fault switches below: faults injected on purpose, for tests and rehearsals of recovery (docs/reliability.md); each switch is refused without it",
    )
    rank: int | None = Field(
        None, ge=0, description="the global rank nan, spike and kill hit; null: every rank"
    )
    nan_at_step: int = Field(
        0,
        ge=0,
        description="that step's loss (and so its gradients) becomes NaN on `faults.rank` (null: every rank); not under PP",
    )
    spike_at_step: int = Field(
        0,
        ge=0,
        description="that step's loss (and so its gradients) is multiplied by `faults.spike_factor` on `faults.rank` (null: every rank); not under PP",
    )
    spike_factor: float = Field(
        100.0,
        gt=0,
        description="the factor of `faults.spike_at_step`",
    )
    sleep_at_step: int = Field(
        0,
        ge=0,
        description="`faults.sleep_rank` stops for `faults.sleep_s` before that step's first collective (the others wait in it)",
    )
    sleep_rank: int = Field(
        0,
        ge=0,
        description="the global rank `faults.sleep_at_step` stops",
    )
    sleep_s: float = Field(
        0.0,
        ge=0,
        description="how long `faults.sleep_at_step` stops the rank, in seconds",
    )
    kill_at_step: int = Field(
        0,
        ge=0,
        description="`faults.rank` (or every rank) exits with SIGKILL once that step is done; only a job's first attempt (a torchrun restart trains past it)",
    )
    oom_at_step: int = Field(
        0,
        ge=0,
        description="that step's forward raises the device's out-of-memory error on `faults.rank` (null: every rank), to rehearse the report it gets",
    )

    @model_validator(mode="after")
    def _guarded(self):
        switches = ("nan_at_step", "spike_at_step", "sleep_at_step", "kill_at_step", "oom_at_step")
        on = [f"faults.{k}={getattr(self, k)}" for k in switches if getattr(self, k)]
        if on and not self.enabled:
            raise ValueError(
                f"{on[0]} injects a fault on purpose (for tests and rehearsals of recovery); "
                "set faults.enabled=true to allow it"
            )
        if self.sleep_at_step and not self.sleep_s:
            raise ValueError("faults.sleep_at_step needs faults.sleep_s > 0 (how long the rank stops)")
        return self


class LadleConfig(Section):
    output_dir: str = Field(
        "runs/default",
        description="the run directory (config.yaml, run_card.json, metrics.jsonl, events.log, checkpoints/)",
    )
    seed: int = Field(0, description="initial weights and the data order are functions of it alone")
    model: ModelConfig = ModelConfig()
    tokenizer: TokenizerConfig
    data: DataConfig
    optim: OptimConfig = OptimConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    parallel: ParallelConfig = ParallelConfig()
    activation_checkpoint: ActivationCheckpointConfig = ActivationCheckpointConfig()
    sample: SampleConfig = SampleConfig()
    eval: EvalConfig = EvalConfig()
    lora: LoRAConfig | None = Field(None, description="adapters instead of full finetuning; null: off")
    dpo: DPOConfig = DPOConfig()
    reward: RewardConfig = RewardConfig()
    grpo: GRPOConfig = GRPOConfig()
    ppo: PPOConfig = PPOConfig()
    distill: DistillConfig = DistillConfig()
    rewards: RewardsConfig = RewardsConfig()
    guard: GuardConfig = GuardConfig()
    device: DeviceConfig = DeviceConfig()
    loggers: LoggersConfig = LoggersConfig()
    profiler: ProfilerConfig = ProfilerConfig()
    dist: DistConfig = DistConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    faults: FaultsConfig = FaultsConfig()

    @model_validator(mode="after")
    def _check_cross(self):
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len}); "
                "lower data.seq_len or raise model.max_seq_len"
            )
        if self.watchdog.timeout_s >= self.dist.timeout_s:
            raise ValueError(
                f"watchdog.timeout_s ({self.watchdog.timeout_s:g}) must be below dist.timeout_s "
                f"({self.dist.timeout_s:g}), so that the watchdog names the hung rank before the "
                "collective's timeout ends the ranks that wait for it; lower it, raise dist.timeout_s, "
                "or set watchdog.timeout_s=0 (off)"
            )
        if self.scheduler.warmup_steps >= self.train.max_steps and self.scheduler.name != "constant":
            raise ValueError(
                f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) must be below "
                f"train.max_steps ({self.train.max_steps})"
            )
        late = [st.step for st in self.data.mix_schedule if st.step >= self.train.max_steps]
        if late:
            raise ValueError(
                f"data.mix_schedule's step {late[0]} is not before train.max_steps ({self.train.max_steps}): "
                "those weights would never be drawn; lower the step or raise train.max_steps"
            )
        for name in ("grpo", "ppo", "distill"):
            env = getattr(self, name).env
            if env is not None and env.max_total_tokens > self.data.seq_len:
                raise ValueError(
                    f"{name}.env.max_total_tokens ({env.max_total_tokens}) exceeds data.seq_len ({self.data.seq_len}), "
                    "the longest row trained on; lower it or raise data.seq_len"
                )
        return self
