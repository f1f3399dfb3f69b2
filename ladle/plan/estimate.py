"""One device's memory at its peak and the step time, for a run config on a layout (`estimate`):
the models a recipe holds (`roles`), their state, one micro-batch's activations times those in
flight, the transient buffers of the layout, the runtime and the margin; the step's compute and
communication. See ladle/plan/__init__.py for what is counted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ladle.checkpoint.init_from import resolve_init_from
from ladle.config.load import apply_preset
from ladle.config.schema import LadleConfig, ModelConfig
from ladle.errors import LadleError
from ladle.models.llama import count_params
from ladle.parallel.mesh import Layout
from ladle.plan import activations as act
from ladle.plan import memory as mem
from ladle.rl.roles import scorer_config
from ladle.train.optim import muon_ns_dtype
from ladle.units import GiB


@dataclass(frozen=True)
class Target:
    devices: int
    memory: int  # bytes per device
    per_node: int = 8
    intra_bw: float = 150.0  # GB/s a rank sustains within a node (bus bandwidth)
    inter_bw: float = 25.0  # GB/s across nodes
    peak_tflops: float = 312.0  # the device's dense bf16 peak (fp32 runs: an eighth)
    mfu: float = 0.4
    margin: float = 0.10
    runtime: int = GiB
    cpu: bool = False  # plan with the CPU's kernels (see activations.py)


@dataclass
class Role:
    """One model a recipe holds: trained (parameters, gradients, optimizer) or frozen."""

    name: str
    model: ModelConfig
    trained: bool
    lora: object = None


@dataclass
class Estimate:
    layout: Layout
    parts: dict[str, int] = field(default_factory=dict)  # bytes on the worst device
    memory: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0  # exposed communication
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.memory

    def as_dict(self) -> dict:
        return {
            "layout": {
                k: getattr(self.layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
            },
            "describe": self.layout.describe(),
            "bytes": dict(self.parts),
            "total_bytes": self.total,
            "device_bytes": self.memory,
            "fits": self.fits,
            "step_s": round(self.step_s, 4),
            "compute_s": round(self.compute_s, 4),
            "exposed_comm_s": round(self.comm_s, 4),
            "notes": self.notes,
        }


def roles(cfg: LadleConfig, recipe: str) -> list[list[Role]]:
    """The models each group of ranks holds (one group, or two in a separated placement)."""
    policy = Role("policy", cfg.model, True, cfg.lora)
    lora_only = cfg.lora is not None and not cfg.lora.modules_to_save  # the reference is the base
    frozen = Role("reference", cfg.model, False)
    if recipe == "dpo":
        online = cfg.dpo.reference == "online" and cfg.dpo.loss != "simpo" and not lora_only
        return [[policy, frozen] if online else [policy]]
    if recipe == "grpo":
        group = [policy] + ([frozen] if cfg.grpo.kl_coef > 0 and not lora_only else [])
        if cfg.rewards.model:
            group.append(Role("reward model", _scorer(cfg, cfg.rewards.model), False))
        if cfg.grpo.placement == "separated":  # the engine's group: a copy of the policy, forward only
            copy = [] if cfg.grpo.engine == "vllm" else [Role("engine", cfg.model, False, cfg.lora)]
            return [group, copy]  # (vLLM's copy is the engine's part below)
        return [group]
    if recipe == "ppo":
        p = cfg.ppo
        actor = [policy] + ([frozen] if p.kl_coef > 0 and not lora_only else [])
        critic = [Role("critic", _scorer(cfg, p.critic_init), True)]
        if cfg.rewards.model:
            critic.append(Role("reward model", _scorer(cfg, cfg.rewards.model), False))
        return [actor, critic] if p.placement == "separated" else [actor + critic]
    if recipe == "distill":  # the frozen teacher, of its own shape, beside the student
        group = [policy, Role("teacher", _teacher(cfg), False)]
        if cfg.rewards.model:
            group.append(Role("reward model", _scorer(cfg, cfg.rewards.model), False))
        return [group]
    return [[policy]]


def _teacher(cfg: LadleConfig) -> ModelConfig:
    """The teacher's shape: from `distill.teacher` where it can be read here, else its
    `teacher_preset`, else the student's."""
    d = cfg.distill
    if d.teacher:
        try:
            return resolve_init_from(ModelConfig(init_from=d.teacher, max_seq_len=cfg.model.max_seq_len))
        except LadleError:
            pass
    if d.teacher_preset:
        data = {"model": {"preset": d.teacher_preset, "max_seq_len": cfg.model.max_seq_len}}
        apply_preset(data)
        return ModelConfig.model_validate({k: v for k, v in data["model"].items() if k != "preset"})
    return cfg.model


def _scorer(cfg: LadleConfig, path: str | None) -> ModelConfig:
    """A score-head model's shape: from `path` where it can be read here, else the policy's."""
    if path:
        try:
            return scorer_config(cfg, path).model
        except LadleError:
            pass
    return cfg.model.model_copy(update={"head": "score"})


def precision(cfg: LadleConfig, target: Target) -> str:
    """The precision mode the run will have (`auto`: bf16-mixed on an accelerator, fp32 on a CPU)."""
    if cfg.precision.mode != "auto":
        return cfg.precision.mode
    return "fp32" if target.cpu else "bf16-mixed"


def checkpointing(cfg: LadleConfig) -> tuple[str, int]:
    """(none | full | selective | op, every how many blocks for selective)."""
    ac = cfg.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode, 1
    return ("op", 1) if ac.selective == "op" else ("selective", ac.selective)


def micro(cfg: LadleConfig, lay: Layout, target: Target) -> act.Micro:
    """One micro-batch's shape and dtypes on a rank of `lay`."""
    mode = precision(cfg, target)
    mixed = mode in ("bf16-mixed", "fp16-mixed")
    half = mode != "fp32"
    gathered = mixed and lay.fsdp  # FSDP's mixed precision gathers bf16 weights: a bf16 residual
    return act.Micro(
        batch=cfg.train.micro_batch_size,
        seq=cfg.data.seq_len,
        compute=2 if half else 4,
        residual=2 if mode == "bf16" or gathered else 4,
        params32=mode != "bf16" and not gathered,
        autocast=mixed,
        tp=lay.tp,
        cp=lay.cp,
        cpu=target.cpu,
    )


def in_flight(cfg: LadleConfig, lay: Layout, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at once."""
    from ladle.parallel.pp import STAGES_PER_RANK

    if lay.pp == 1:
        return 1
    p, M = cfg.parallel, cfg.train.grad_accum_steps
    if p.pp_schedule == "gpipe":
        return M
    v = STAGES_PER_RANK[p.pp_schedule]
    if v == 1:
        return min(M, lay.pp - rank)
    return min(M, lay.pp * (1 + (lay.pp - 1) / (lay.pp * v)))


def estimate(cfg: LadleConfig, recipe: str, lay: Layout, target: Target) -> Estimate:
    """Peak bytes on the fullest device of `lay` and the step time, for `cfg` run by `recipe`."""
    est = Estimate(lay, memory=target.memory)
    m = micro(cfg, lay, target)
    mode = precision(cfg, target)
    ac_mode, every = checkpointing(cfg)
    best = None
    for group in roles(cfg, recipe):
        merged = None
        for role in group:
            per = _role_parts(cfg, role, lay, m, target, mode, ac_mode, every, len(group) > 1)
            merged = per if merged is None else [_merge(a, b) for a, b in zip(merged, per, strict=True)]
        merged = merged or [{}]  # a separated vLLM engine rank: vLLM's copy alone
        name = group[0].name if group else "engine"
        # the group that generates: the policy's, or a separated placement's engine ranks
        generates = "engine" if recipe == "grpo" and cfg.grpo.placement == "separated" else "policy"
        if recipe in ("grpo", "ppo", "distill") and name == generates:
            section = getattr(cfg, recipe)
            if section.engine == "vllm":
                part = {"vLLM engine (weights, KV cache)": _engine(cfg, section, target, m)}
            else:
                part = {"generation (KV cache, logits)": _generation(cfg, recipe, lay, m)}
            merged = [{**d, **part} for d in merged]
        worst = max(merged, key=lambda d: sum(d.values()))
        if best is None or sum(worst.values()) > sum(best.values()):
            best = worst
    body = sum(best.values())
    best["runtime (context, collective buffers)"] = target.runtime
    best["fragmentation margin"] = int(target.margin * body)
    est.parts = best
    _timing(est, cfg, recipe, lay, target, m, mode)
    return est


# Parts that exist while one model runs: the models of a group run one after another, so the
# group needs the largest of each, not the sum (their state is summed).
TRANSIENT = (
    "activations",
    "recomputed block",
    "autocast weight copies",
    "loss backward",
    "communication buffers",
    "optimizer workspace",
)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0), v) if k in TRANSIENT else out.get(k, 0) + v
    return out


def _role_parts(cfg, role: Role, lay: Layout, m: act.Micro, target: Target, mode, ac_mode, every, named):
    """Per pipeline rank, the bytes `role` takes: its state (named after it when the group holds
    several models) and, trained, what its step holds."""
    p = cfg.parallel
    param_bytes = 2 if mode == "bf16" else 4
    gather_bytes = m.compute if mode != "fp32" else 4
    reduce_bytes = 2 if p.fsdp_reduce_dtype == "bfloat16" and mode == "bf16-mixed" else param_bytes
    ts = mem.tensors(role.model, role.trained, role.lora)
    out = []
    states = mem.state(ts, lay, param_bytes, role.model.n_layers, p.pp_schedule, p.pp_split, cfg.optim.name)
    for r, st in enumerate(states):
        prefix = f"{role.name}: " if named else ""
        parts = {
            f"{prefix}parameters": st["params"],
            f"{prefix}gradients": st["grads"],
            f"{prefix}optimizer state": st["optimizer"],
        }
        if role.trained:
            saved = act.saved(role.model, m, st["layers"], ac_mode, every, st["first"], st["last"])
            recompute = saved.pop("recompute", 0)
            flight = in_flight(cfg, lay, r)
            parts["activations"] = int(sum(saved.values()) * flight)
            parts["recomputed block"] = recompute  # checkpointing: one block's activations again
            if cfg.optim.name == "muon":  # Newton-Schulz on a whole matrix
                ns = 2 if muon_ns_dtype(cfg.optim, mode) == "bfloat16" else 4
                parts["optimizer workspace"] = mem.muon_workspace(ts, param_bytes, ns, lay)
            if m.autocast and m.params32 and not lay.fsdp:
                plain = st["layers"] if ac_mode == "none" else 0
                copies = plain * mem.block_elements(ts, lay) + (
                    mem.root_elements(ts, lay) if st["last"] else 0
                )
                # one copy a step: the pipeline schedule runs in one autocast context (its cache)
                parts["autocast weight copies"] = act.weight_copies(role.model, m, copies)
            if st["last"] and role.model.head == "lm":
                vocab = role.model.vocab_size
                chunk = min(m.tokens, (2**20 if target.cpu else 2**26) // vocab)
                parts["loss backward"] = m.tokens * (vocab // lay.tp) * m.compute + chunk * vocab * 4
        parts["communication buffers"] = _buffers(
            ts, lay, role.trained, gather_bytes, reduce_bytes, param_bytes, p
        )
        out.append({k: v for k, v in parts.items() if v})
    return out


def _buffers(ts, lay, trained, gather_bytes, reduce_bytes, param_bytes, p) -> int:
    if lay.fsdp:
        block = mem.block_elements(ts, lay)
        root = mem.root_elements(ts, lay)
        held = (2 if p.reshard_after_forward else 10**9) * block  # this block and the next
        layers = sum(1 for t in ts if t.name.endswith("input_layernorm.weight"))
        held = min(held, layers * block)
        grads = block * (param_bytes + reduce_bytes) if trained else 0
        return held * gather_bytes + root * gather_bytes + grads
    if lay.dp > 1 and trained:  # DDP's buckets: a copy of the gradients
        return sum(math.prod(mem.local_shape(t, lay)) for t in ts if t.trained) * param_bytes
    return 0


def _generation(cfg: LadleConfig, recipe: str, lay: Layout, m: act.Micro) -> int:
    """A rollout batch's KV cache (prompt and response) and last-position fp32 logits."""
    section = getattr(cfg, recipe)
    rows = section.rollout_batch
    length = cfg.data.seq_len + section.max_response_len
    mc = cfg.model
    cache = 2 * rows * length * mc.n_layers // lay.pp * (mc.kv_heads // lay.tp) * mc.head_size * m.compute
    return cache + rows * mc.vocab_size * 4


def _engine(cfg: LadleConfig, section, target: Target, m: act.Micro) -> int:
    """The colocated vLLM engine's share of each device (ladle/rl/vllm.py): its whole copy of
    the weights in the compute precision plus `kv_cache_memory_bytes` when that is set, else the
    `gpu_memory_utilization` share of the device it reserves (0.3 by default)."""
    args = section.engine_args
    if "kv_cache_memory_bytes" in args:
        return count_params(cfg.model) * m.compute + int(args["kv_cache_memory_bytes"])
    return int(float(args.get("gpu_memory_utilization", 0.3)) * target.memory)


def _group_bw(lay: Layout, dim: str, target: Target) -> float:
    """GB/s of the group along `dim` (mesh order pp, dp_replicate, dp_shard, cp, tp: tp innermost)."""
    order = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    inner = math.prod(getattr(lay, d) for d in order[order.index(dim) + 1 :])
    return target.intra_bw if inner * getattr(lay, dim) <= target.per_node else target.inter_bw


def _timing(est, cfg, recipe, lay, target, m, mode) -> None:
    from ladle.models.llama import count_params
    from ladle.train.metrics import flops_per_token

    mc = cfg.model
    n = count_params(mc, exclude_embeddings=True, active=True)
    fpt = flops_per_token(n, mc.n_layers, mc.n_heads, mc.head_size, cfg.data.seq_len)
    if recipe == "ppo":
        fpt *= 2  # the critic trains alongside (same shape by default)
    if recipe == "distill":  # the teacher's forward on every token trained (a third of a step)
        t = _teacher(cfg)
        fpt += (
            flops_per_token(
                count_params(t, exclude_embeddings=True, active=True),
                t.n_layers,
                t.n_heads,
                t.head_size,
                cfg.data.seq_len,
            )
            / 3
        )
    M = cfg.train.grad_accum_steps
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len * M  # per data-parallel rank
    peak = target.peak_tflops * 1e12 * (1 / 8 if mode == "fp32" else 1)
    compute = fpt * tokens / (lay.tp * lay.pp * lay.cp) / (peak * target.mfu)
    if lay.pp > 1:
        from ladle.parallel.pp import STAGES_PER_RANK

        v = STAGES_PER_RANK[cfg.parallel.pp_schedule]
        compute *= 1 + (lay.pp - 1) / (M * v)  # the pipeline bubble
    param = mem.tensors(mc)
    full_bytes = sum(math.prod(mem.local_shape(t, Layout(tp=lay.tp, ep=lay.ep))) for t in param) * m.compute
    overlapped = 0.0
    fs = lay.dp_shard * lay.cp
    if lay.fsdp and fs > 1:
        bw = _group_bw(lay, "dp_shard", target) * 1e9
        overlapped += M * 3 * full_bytes / lay.pp * (fs - 1) / fs / bw  # 2 gathers + 1 reduce-scatter
    if lay.dp_replicate > 1:
        bw = _group_bw(lay, "dp_replicate", target) * 1e9
        shard = full_bytes / lay.pp / (fs if lay.fsdp else 1)
        overlapped += 2 * shard * (lay.dp_replicate - 1) / lay.dp_replicate / bw
    exposed = 0.0
    act_bytes = m.tokens * mc.dim * m.compute  # one full-sequence activation of a micro-batch
    layers = mc.n_layers / lay.pp
    if lay.tp > 1:  # per block: 2 all-gathers and 2 reduce-scatters forward, as many backward
        exposed += M * layers * 8 * act_bytes * (lay.tp - 1) / lay.tp / (_group_bw(lay, "tp", target) * 1e9)
    if lay.cp > 1:
        kv = m.tokens * lay.cp * 2 * (mc.kv_heads // lay.tp) * mc.head_size * m.compute
        exposed += M * layers * 2 * kv * (lay.cp - 1) / lay.cp / (_group_bw(lay, "cp", target) * 1e9)
    if lay.ep > 1 and mc.moe:
        pairs = m.tokens * mc.moe.top_k * mc.dim * m.compute
        exposed += M * layers * 4 * pairs * (lay.ep - 1) / lay.ep / (_group_bw(lay, "dp_shard", target) * 1e9)
    if lay.pp > 1:
        exposed += 2 * M * act_bytes / lay.tp / (_group_bw(lay, "pp", target) * 1e9)
    est.compute_s = compute
    est.comm_s = exposed + max(0.0, overlapped - compute)
    est.step_s = compute + est.comm_s


# -- layouts ----------------------------------------------------------------------------------
