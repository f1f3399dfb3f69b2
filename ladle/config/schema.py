"""The config schema: one pydantic model per section, composed into `LadleConfig`.

Every section forbids unknown keys (the loader turns that into a "did you mean" hint) and checks
its own ranges; checks that span sections live in `LadleConfig`. Checks that need the file system
(tokenizer vocabulary, prepared data) live in `ladle.prelaunch`, so this module stays pure.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """Llama-3.1 frequency scaling of RoPE (HF `rope_scaling` with `rope_type: llama3`)."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_seq_len: int = Field(8192, ge=1)

    @model_validator(mode="after")
    def _check_factors(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor must be greater than low_freq_factor")
        return self


class MoEConfig(Section):
    """Mixture of experts in every layer's MLP (Mixtral, Qwen3-MoE): a softmax router picks
    `top_k` of `n_experts` SwiGLU experts per token, with no token dropped (see ladle/models/moe.py)."""

    n_experts: int | None = Field(None, ge=2, description="required unless model.init_from gives it")
    top_k: int = Field(2, ge=1)
    ffn_dim: int | None = Field(
        None,
        ge=1,
        description="hidden size of each expert's SwiGLU; required unless model.init_from gives it",
    )
    norm_topk_prob: bool = Field(
        True, description="renormalise the top-k router probabilities to sum to 1 (Mixtral: always)"
    )
    aux_loss_weight: float = Field(
        0.001, ge=0, description="load-balancing loss weight (HF router_aux_loss_coef); 0 disables"
    )
    z_loss_weight: float = Field(0.0, ge=0, description="router z-loss weight (ST-MoE uses 1e-3); 0 disables")
    dispatch: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto",
        description="expert matmuls: one grouped matmul, a loop over experts, or auto (grouped where it runs)",
    )

    @model_validator(mode="after")
    def _check_top_k(self):
        if self.n_experts is not None and self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        return self


class ModelConfig(Section):
    """A decoder of the Llama family (Llama 2/3, Qwen2 with `qkv_bias`, Qwen3 with `qk_norm`,
    Mistral without a sliding window), dense or with a `moe` section (Mixtral, Qwen3-MoE).
    `family` names the Hugging Face architecture it exports as."""

    preset: str | None = Field(
        None,
        description="a bundled model definition (e.g. llama-3.1-8b) that fills this section's other keys",
    )
    family: Literal["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"] = "llama"
    vocab_size: int = Field(32000, ge=1)
    dim: int = Field(512, ge=1)
    n_layers: int = Field(8, ge=1)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="None: same as n_heads (no GQA)")
    head_dim: int | None = Field(None, ge=1, description="None: dim // n_heads")
    ffn_dim: int = Field(1408, ge=1, description="hidden size of the dense SwiGLU (unused when moe is set)")
    max_seq_len: int = Field(2048, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    init_std: float = Field(0.02, gt=0)
    head: Literal["lm", "score"] = Field(
        "lm",
        description="lm: next-token logits; score: one scalar per position (a reward model's head, "
        "HF's ...ForSequenceClassification with num_labels 1); `ladle run reward` sets it",
    )
    moe: MoEConfig | None = Field(None, description="mixture of experts in every layer; None: dense")
    init_from: str | None = Field(
        None,
        description="a Hugging Face model folder, ladle checkpoint or run directory to start from: it gives "
        "the shape and the weights (not the optimizer state or the step)",
    )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

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
        if self.init_from:  # the checkpoint's config.json gives the family and the experts
            return self
        moe_family = self.family in ("mixtral", "qwen3_moe")
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
    path: str = Field(..., description="folder with a Hugging Face tokenizer.json")


class DataConfig(Section):
    path: str = Field(..., description="folder written by `ladle data prepare`")
    seq_len: int = Field(512, ge=1)
    prefetch: int = Field(2, ge=1, description="batches prepared ahead in the background")
    shared_read: bool = Field(
        True,
        description="ranks of one TP/CP/PP group: the first reads each step's batches and broadcasts "
        "them, the others receive (false: each reads its own copy)",
    )
    packing: bool = Field(
        True,
        description="SFT: several chats per row (each its own document); false: one chat per row, padded",
    )
    document_mask: bool = Field(
        True,
        description="packed documents attend only to themselves, with positions restarting at each; "
        "false: plain causal attention over the whole sample",
    )
    verify: Literal["sizes", "checksums"] = Field(
        "sizes",
        description="before training: every file meta.json lists is there, whole (its size) and agrees "
        "with its index; checksums: also its sha256 (reads all the data once)",
    )


class OptimConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    decay_norms_biases_embeddings: bool = Field(
        False, description="apply weight decay to norms, biases and embeddings too"
    )
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, v):
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class SchedulerConfig(Section):
    name: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of optim.lr")
    decay_ratio: float = Field(
        0.2, gt=0, le=1, description="wsd: fraction of the steps after warmup spent decaying"
    )


class TrainConfig(Section):
    max_steps: int = Field(1000, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="0: only at the end")
    eval_steps: int = Field(10, ge=0, description="validation batches per evaluation; 0 disables")
    eval_at_start: bool = Field(False, description="validate once before the first step too (a baseline)")
    resume: str = Field(
        "never", description="never | auto (continue from checkpoints/latest) | PATH of a checkpoint"
    )
    exit_at_step: int = Field(
        0, ge=0, description="stop (with a checkpoint) at this step, keeping the max_steps schedule; 0: off"
    )
    exit_after_minutes: float = Field(
        0,
        ge=0,
        description="stop (with a checkpoint) after this much wall time, e.g. a job's time limit; 0: off",
    )
    device: str = Field("auto", description="auto | cpu | cuda | npu (optionally with :index)")
    allow_data_change: bool = Field(
        False,
        description="resume although the tokenizer or the prepared data differ from the checkpoint's "
        "(else refused, naming what changed)",
    )
    threads: int = Field(0, ge=0, description="CPU threads for torch; 0 leaves torch's default")
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (inductor: CPU and CUDA); the first step pays for it",
    )


class PrecisionConfig(Section):
    mode: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16"] = Field(
        "bf16-mixed",
        description="auto: bf16-mixed where the device computes bf16 natively, else fp16-mixed "
        "(a GPU without bf16) or fp32 (a CPU that only emulates bf16)",
    )
    init_loss_scale: float = Field(2.0**16, gt=0, description="fp16-mixed: starting loss scale")
    loss_scale_window: int = Field(1000, ge=1, description="fp16-mixed: good steps before growth")


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="save every N steps; 0: only at the end")
    keep_last: int = Field(2, ge=1)
    async_save: bool = False


class ParallelConfig(Section):
    """The parallel layout over all processes (ladle/parallel/mesh.py): their product is the world
    size. Checked against the world and the model before any process starts."""

    dp_replicate: int = Field(1, ge=1, description="data-parallel replicas (DDP alone; HSDP with dp_shard)")
    dp_shard: int = Field(-1, ge=-1, description="FSDP2 shards; -1 takes what the other degrees leave")
    tp: int = Field(1, ge=1, description="tensor parallel (with sequence parallel and loss parallel)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    cp: int = Field(1, ge=1, description="context parallel (sequence sharding)")
    cp_attention: Literal["allgather", "ring"] = Field(
        "allgather",
        description="context parallel attention: all-gathered keys and values (any device, document "
        "masks), or PyTorch's ring attention (CUDA, needs data.document_mask=false)",
    )
    async_tp: bool = Field(
        False,
        description="tensor parallel: inductor's micro-pipelining overlaps each all-gather and "
        "reduce-scatter with its matmul (needs CUDA and train.compile=true)",
    )
    ep: int = Field(1, ge=1, description="expert parallel (MoE models)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = Field(
        "1f1b", description="pipeline schedule; the interleaved ones and zbv put two stages on each rank"
    )
    pp_split: list[int] | None = Field(
        None, description="layer indices where stages 1, 2, ... begin; null: as even as can be"
    )
    reshard_after_forward: bool = Field(
        True,
        description="FSDP: free the gathered weights after forward (less memory, another all-gather in backward)",
    )
    cpu_offload: bool = Field(
        False, description="FSDP: keep sharded weights, gradients and optimizer state on the host"
    )
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP under bf16-mixed: dtype of the gradient reduce-scatter"
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
        "none", description="full: recompute every block in backward; selective: see `selective`"
    )
    selective: Literal["op"] | int = Field(
        "op",
        description="op: keep matmul and attention outputs, recompute the cheap ops; N: checkpoint every N-th block",
    )
    offload: bool = Field(False, description="keep the saved activations in host memory (accelerators)")

    @field_validator("selective")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("a block interval must be at least 1 (or 'op')")
        return v


class SampleConfig(Section):
    """A generated sample printed at the end of a run (the demo's "does it write Python?")."""

    prompt: str = ""
    max_new_tokens: int = Field(64, ge=0)
    temperature: float = Field(0.8, ge=0)
    top_k: int = Field(50, ge=0)


class LoRAConfig(Section):
    """Low-rank adapters (ladle/models/lora.py): the base model frozen, only the adapters trained,
    checkpointed and exported (PEFT's format), or merged into the base for export."""

    rank: int = Field(8, ge=1, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, description="scaling alpha / r (rsLoRA: alpha / sqrt(r))")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="linear modules to adapt, by name: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj",
    )
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r)")
    dora: bool = Field(
        False, description="DoRA: a learned magnitude per output row on top of the low-rank direction"
    )
    modules_to_save: list[Literal["embed_tokens", "lm_head"]] = Field(
        [],
        description="modules trained in full beside the adapters (PEFT's modules_to_save): the input "
        "embedding and/or the output head, for tokens the base never learned (chat markers, new "
        "words); with tied embeddings either name trains the one shared matrix",
    )
    quantize_base: Literal["none", "nf4"] = Field(
        "none",
        description="QLoRA: the frozen base's block linears stored in 4-bit NF4, dequantized per layer",
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
    """Direct preference optimisation and its family (`ladle run dpo`, ladle/train/preference.py)."""

    loss: Literal[DPO_LOSSES] = Field(
        "sigmoid",
        description="sigmoid (DPO), ipo (on per-token mean log-ratios), hinge (SLiC), robust (rDPO, "
        "with label_smoothing), simpo (length-normalised, no reference)",
    )
    beta: float = Field(0.1, gt=0, description="the KL strength beta (IPO's tau)")
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="the share of flipped labels assumed: conservative DPO (cDPO) "
        "for sigmoid, robust DPO for robust; 0: off",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target margin gamma")
    rpo_alpha: float = Field(
        0.0, ge=0, description="weight of an added NLL term on the chosen completions (RPO); 0: off"
    )
    reference: Literal["cached", "online"] = Field(
        "cached",
        description="cached: the reference log-probs computed once before training and stored in the run "
        "directory with the data's hash (no reference model in memory); online: a frozen reference model "
        "beside the policy (with LoRA: the policy with its adapters switched off)",
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

    margin: float = Field(0.0, description="required margin m: -log sigmoid(r_chosen - r_rejected - m)")
    center_coef: float = Field(
        0.0, ge=0, description="weight of the centring term mean((r_chosen + r_rejected)^2); 0: off"
    )


class RolloutConfig(Section):
    """How the RL recipes sample their responses (ladle/train/rollout.py)."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0: off")
    max_response_len: int = Field(256, ge=1, description="response tokens at most (the cap)")
    stop: list[str] = Field(default_factory=list, description="strings that end a response")
    rollout_batch: int = Field(64, ge=1, description="rows per generation batch")
    balance: bool = Field(
        True,
        description="move whole groups between data-parallel ranks after generation to even their training tokens",
    )
    micro_tokens: int = Field(
        0,
        ge=0,
        description="training microbatches of at most this many padded tokens, rows of like length "
        "together (whole groups); 0: one per prompt microbatch",
    )
    offload_idle: bool = Field(
        True,
        description="on an accelerator, models a phase does not use wait in host memory (shared placement)",
    )


class GRPOConfig(RolloutConfig):
    """Group relative policy optimisation on the policy's own rollouts (`ladle run grpo`,
    ladle/train/grpo.py, docs/rl.md)."""

    num_samples: int = Field(8, ge=1, description="responses sampled per prompt (the group)")
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="grpo: r - group mean; rloo: leave-one-out; reinforce_pp: whitened over the batch"
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's or the batch's std (none: Dr. GRPO)"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference; 0: no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratios below 1 - clip_low are clipped")
    clip_high: float = Field(0.2, ge=0, description="ratios above 1 + clip_high are clipped (DAPO: 0.28)")
    importance: Literal["token", "sequence"] = Field("token", description="sequence: GSPO")
    num_iterations: int = Field(
        1, ge=1, description="optimizer steps per rollout batch, on its old log-probs"
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus; 0: logged only")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal, sample more prompts to refill"
    )
    max_sampling_rounds: int = Field(3, ge=1, description="rounds of sampling a step may take to refill")
    mask_truncated: bool = Field(
        False, description="DAPO's overlong filtering: responses cut by the cap stay out of the loss"
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
        return self


class PPOConfig(RolloutConfig):
    """Proximal policy optimisation with a value model (`ladle run ppo`, ladle/train/ppo.py,
    docs/rl.md)."""

    num_samples: int = Field(1, ge=1, description="responses sampled per prompt")
    kl_coef: float = Field(
        0.05, ge=0, description="weight of the per-token KL to the reference in the reward; 0: no reference"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    gamma: float = Field(1.0, ge=0, le=1, description="discount of GAE")
    lam: float = Field(0.95, ge=0, le=1, description="lambda of GAE")
    whiten_advantages: bool = Field(True, description="advantages whitened over the rollout batch")
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float = Field(0.0, ge=0, description="> 1: cap a negative advantage's loss at -c A; 0: off")
    value_clip: float = Field(0.2, ge=0, description="values move at most this far from the old ones; 0: off")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus; 0: logged only")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    minibatches: int = Field(
        1, ge=1, description="optimizer steps per pass: train.grad_accum_steps must be a multiple"
    )
    critic_init: str | None = Field(
        None,
        description="the value model's start: a reward model (run dir, checkpoint or HF folder); "
        "null: rewards.model if set, else the policy's model.init_from with a new value head",
    )
    critic_lr: float | None = Field(None, gt=0, description="the value model's learning rate; null: optim.lr")
    placement: Literal["shared", "separated"] = Field(
        "shared",
        description="shared: every model on every rank (idle ones parked: offload_idle); separated: the "
        "actor and reference on half the ranks, the critic and reward model on the other half, each "
        "half laid out by parallel.*",
    )

    @model_validator(mode="after")
    def _dual_clip(self):
        if 0 < self.dual_clip <= 1:
            raise ValueError(f"ppo.dual_clip={self.dual_clip}: must be above 1 (or 0: off)")
        return self


class RewardsConfig(Section):
    """The rewards of the RL recipes (ladle/rewards.py): weighted terms by name."""

    terms: list[dict] = Field(
        default_factory=lambda: [{"name": "exact"}],
        description="[{name, weight, key, options...}]: registered rewards (exact, regex, math, format, "
        "length) or functions of `file`",
    )
    file: str | None = Field(None, description="a Python file of your own reward functions")
    model: str | None = Field(
        None,
        description="a reward model (`ladle run reward` run dir, checkpoint or HF folder): its score "
        "of the whole response is a term, logged as reward_model",
    )
    model_weight: float = Field(1.0, description="the reward model's weight in the sum")


class GuardConfig(Section):
    """What a bad step does (ladle/train/guard.py): a non-finite loss or gradient norm is always
    skipped; a spike (the loss or the gradient norm far above its recent mean) is logged, and
    skipped with `skip_spikes`; too many skips in a row roll the run back or stop it."""

    z_threshold: float = Field(
        6.0,
        ge=0,
        description="a loss or gradient norm this many standard deviations above its mean over the "
        "window is a spike; 0: no spike detection",
    )
    window: int = Field(100, ge=2, description="the accepted steps the mean and deviation are taken over")
    min_history: int = Field(
        20, ge=2, description="no spike is called before the window holds this many steps"
    )
    skip_spikes: bool = Field(False, description="skip a spike's update (else it is logged and applied)")
    max_skips: int = Field(
        3,
        ge=1,
        description="skipped steps in a row (non-finite, or spikes with skip_spikes) before on_max_skips",
    )
    on_max_skips: Literal["rollback", "stop"] = Field(
        "rollback",
        description="rollback: reload the last checkpoint and go on past the data read since (stop when "
        "there is none, or after max_rollbacks); stop: stop naming the cause and the last checkpoint",
    )
    rollback_lr_factor: float = Field(
        1.0, gt=0, le=1, description="the learning rate is multiplied by this at each rollback (e.g. 0.5)"
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
        description="the caching allocator's settings, e.g. expandable_segments:True (less "
        "fragmentation), set as PYTORCH_CUDA_ALLOC_CONF on CUDA or PYTORCH_NPU_ALLOC_CONF on NPU; "
        "'': as the environment says",
    )


class DistConfig(Section):
    """The process group (ladle/distributed.py)."""

    timeout_s: float = Field(
        600.0,
        gt=0,
        description="a collective that waits longer fails (every rank's error names it) instead of hanging",
    )


class WatchdogConfig(Section):
    """The hang watchdog (ladle/watchdog.py): a rank stuck in one phase is reported, every rank's
    stacks are dumped, and the job exits with status 3 so that the launcher restarts it."""

    timeout_s: float = Field(
        300.0,
        ge=0,
        description="a rank whose phase (data, forward, backward, optimizer, a collective, checkpoint, "
        "generation) has not changed for this long is hung; below dist.timeout_s, which applies "
        "until the first step is done; 0: off",
    )


class FaultsConfig(Section):
    """Faults injected on purpose, to rehearse recovery and to test it (ladle/train/faults.py);
    each switch is refused unless `enabled`. Steps count from 1; 0 is off. A job's restarted
    attempt is not hit (torchrun's TORCHELASTIC_RESTART_COUNT > 0), so it trains past the step."""

    enabled: bool = Field(False, description="allow the switches below (tests and rehearsals only)")
    rank: int | None = Field(
        None, ge=0, description="the global rank nan, spike and kill hit; null: every rank"
    )
    nan_at_step: int = Field(0, ge=0, description="that step's loss (and so its gradients) becomes NaN")
    spike_at_step: int = Field(0, ge=0, description="that step's loss (and gradients) times spike_factor")
    spike_factor: float = Field(100.0, gt=0)
    sleep_at_step: int = Field(
        0, ge=0, description="sleep_rank stops for sleep_s before the step's first collective"
    )
    sleep_rank: int = Field(0, ge=0)
    sleep_s: float = Field(0.0, ge=0)
    kill_at_step: int = Field(0, ge=0, description="the rank exits with SIGKILL once that step is done")

    @model_validator(mode="after")
    def _guarded(self):
        switches = ("nan_at_step", "spike_at_step", "sleep_at_step", "kill_at_step")
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
    output_dir: str = "runs/default"
    seed: int = 0
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
    lora: LoRAConfig | None = Field(None, description="adapters instead of full finetuning; null: off")
    dpo: DPOConfig = DPOConfig()
    reward: RewardConfig = RewardConfig()
    grpo: GRPOConfig = GRPOConfig()
    ppo: PPOConfig = PPOConfig()
    rewards: RewardsConfig = RewardsConfig()
    guard: GuardConfig = GuardConfig()
    device: DeviceConfig = DeviceConfig()
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
        return self
