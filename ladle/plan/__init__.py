"""The memory and layout planner: will a run fit on its devices, and which layout is fastest?

`estimate(cfg, recipe, layout, target)` adds up one device's memory at its peak, part by part:

- state (ladle/plan/memory.py): parameters, gradients and optimizer state of every model the recipe
  holds (the policy; DPO's online reference; GRPO's and PPO's reference, PPO's critic, a reward
  model), each as ladle lays it out, on the worst pipeline rank (and the fuller group of a
  separated placement);
- activations (ladle/plan/activations.py): one micro-batch's saved tensors times the micro-batches
  a pipeline schedule keeps in flight (GPipe all of them, 1F1B `pp` on the first rank, the
  interleaved schedules Megatron's `pp x (1 + (pp - 1) / (pp x v))`), plus one block's worth
  recomputed under checkpointing and autocast's bf16 weight copies;
- transient buffers: FSDP2's gathered blocks (this one and the prefetched next) and the block's
  unsharded gradients with their reduce-scatter input, the root's gathered embedding and head for
  the whole step; DDP's gradient buckets; the logits' gradient and the loss's fp32 chunk in
  backward; an RL recipe's generation (KV cache and last-position logits of a rollout batch);
- the runtime (CUDA/CANN context, NCCL/HCCL buffers: `Target.runtime`, 1 GiB by default) and a
  margin for the allocator's fragmentation (`Target.margin` of the rest, 10% by default).

Step time: the training FLOPs of the step (ladle/train/metrics.py's 6N + attention) at a stated
MFU of a stated peak, the pipeline bubble, plus communication: FSDP, DDP and HSDP traffic overlaps
the compute (only what exceeds it is exposed); tensor, context, expert and pipeline parallel
traffic sits on the critical path. A collective over n ranks moves (n - 1) / n of its bytes per
rank (an all-reduce twice that), over the intra-node bandwidth when its ranks share a node, else
over the inter-node one. These are estimates for ranking layouts, not promises.

`layouts(cfg, recipe, target)` enumerates the layouts of `target.devices` (tensor parallel within
a node), `remedy(...)` finds the first change that fits in the order users should try them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ladle.config.schema import LadleConfig, ModelConfig
from ladle.errors import ConfigError, LadleError
from ladle.parallel.mesh import Layout
from ladle.plan import activations as act
from ladle.plan import memory as mem
from ladle.rl.roles import scorer_config
from ladle.units import GiB, parse_size


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
        return [group]
    if recipe == "ppo":
        p = cfg.ppo
        actor = [policy] + ([frozen] if p.kl_coef > 0 and not lora_only else [])
        critic = [Role("critic", _scorer(cfg, p.critic_init), True)]
        if cfg.rewards.model:
            critic.append(Role("reward model", _scorer(cfg, cfg.rewards.model), False))
        return [actor, critic] if p.placement == "separated" else [actor + critic]
    return [[policy]]


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
        if recipe in ("grpo", "ppo") and group[0].name == "policy":
            gen = _generation(cfg, recipe, lay, m)
            merged = [{**d, "generation (KV cache, logits)": gen} for d in merged]
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
    for r, st in enumerate(mem.state(ts, lay, param_bytes, role.model.n_layers, p.pp_schedule, p.pp_split)):
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
    section = cfg.grpo if recipe == "grpo" else cfg.ppo
    rows = section.rollout_batch
    length = cfg.data.seq_len + section.max_response_len
    mc = cfg.model
    cache = 2 * rows * length * mc.n_layers // lay.pp * (mc.kv_heads // lay.tp) * mc.head_size * m.compute
    return cache + rows * mc.vocab_size * 4


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
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(cfg: LadleConfig, **degrees) -> LadleConfig:
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=degrees)})


def _degrees(cfg: LadleConfig, world: int, per_node: int):
    """(dp_replicate, dp_shard, tp, pp, cp, ep) of `world` ranks: tensor parallel within a node;
    context parallel only for long sequences or where the config asks for it; data parallel
    sharded over all, replicated over all, or (HSDP) sharded within a node and replicated across;
    expert parallel over any divisor of dp_shard (MoE)."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // tp // pp):
                if tp > per_node or (cp > 1 and cfg.parallel.cp == 1 and cfg.data.seq_len < 16384):
                    continue
                dp = world // tp // pp // cp
                replicates = {1, dp}
                node = per_node // (tp * cp) if per_node % (tp * cp) == 0 else 0
                if node and dp % node == 0:
                    replicates.add(dp // node)
                for rep in sorted(replicates):
                    for ep in divisors(dp // rep) if cfg.model.moe else [1]:
                        yield rep, dp // rep, tp, pp, cp, ep


def layouts(
    cfg: LadleConfig, recipe: str, target: Target, global_batch: int
) -> list[tuple[LadleConfig, Layout | None, str]]:
    """Every layout of the devices for the same global batch (sequences a step; accumulation
    makes up the rest): (its config, its layout or None, why it cannot run)."""
    from ladle.parallel.mesh import check_layout

    groups = len(roles(cfg, recipe))
    out = []
    for rep, shard, tp, pp, cp, ep in _degrees(cfg, target.devices // groups, target.per_node):
        c = with_layout(cfg, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep)
        per_step = cfg.train.micro_batch_size * rep * shard  # accumulation takes up the rest
        if global_batch % per_step:
            why = (
                f"{rep * shard} data ranks x micro-batch {cfg.train.micro_batch_size} do not divide "
                f"the global batch of {global_batch} sequences"
            )
            out.append((c, None, why))
            continue
        train = c.train.model_copy(update={"grad_accum_steps": global_batch // per_step})
        c = c.model_copy(update={"train": train})
        try:
            out.append((c, check_layout(c, target.devices, groups, "the separated placement"), ""))
        except ConfigError as e:
            out.append((c, None, str(e).split(": ", 1)[-1]))
    return out


def rank(
    cfg: LadleConfig, recipe: str, target: Target, global_batch: int
) -> tuple[list[Estimate], list[tuple[str, str]]]:
    """(estimates of every valid layout, fitting ones first by step time; (layout, why not) of the others)."""
    ests, invalid = [], []
    for c, lay, why in layouts(cfg, recipe, target, global_batch):
        if lay is None:
            p = c.parallel
            name = (
                f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}"
            )
            invalid.append((name, why))
            continue
        e = estimate(c, recipe, lay, target)
        if c.train.grad_accum_steps != cfg.train.grad_accum_steps:
            e.notes.append(f"train.grad_accum_steps={c.train.grad_accum_steps}")
        ests.append(e)
    ests.sort(key=lambda e: (not e.fits, e.step_s if e.fits else e.total))
    return ests, invalid


# -- remedies ---------------------------------------------------------------------------------
def remedy(cfg: LadleConfig, recipe: str, lay: Layout, target: Target) -> tuple[list[str], Estimate] | None:
    """The first change that fits, trying in order: mixed precision, gradient accumulation (a
    smaller micro-batch, the same global batch), sharding, activation checkpointing, a smaller
    micro-batch. Changes accumulate; None when even all of them do not fit."""
    from ladle.parallel.mesh import check_layout

    changes: list[str] = []
    c = cfg

    def fits(c2: LadleConfig):
        try:
            lay2 = check_layout(c2, lay.world * lay.roles, lay.roles, "the separated placement")
        except ConfigError:
            return None
        e = estimate(c2, recipe, lay2, target)
        return e if e.fits else None

    def step(update: dict, text: str):
        nonlocal c
        trial = c.model_copy(update=update)
        changes.append(text)
        c = trial
        return fits(trial)

    def halve_micro():
        mb = c.train.micro_batch_size // 2
        ga = c.train.grad_accum_steps * c.train.micro_batch_size // mb
        changes[:] = [
            x for x in changes if not x.startswith("train.micro_batch_size")
        ]  # the last one says it
        return step(
            {"train": c.train.model_copy(update={"micro_batch_size": mb, "grad_accum_steps": ga})},
            f"train.micro_batch_size={mb} train.grad_accum_steps={ga} (the same global batch)",
        )

    if c.precision.mode in ("fp32", "auto") and not target.cpu:
        e = step(
            {"precision": c.precision.model_copy(update={"mode": "bf16-mixed"})}, "precision.mode=bf16-mixed"
        )
        if e:
            return changes, e
    if c.train.micro_batch_size > 1 and (e := halve_micro()):
        return changes, e
    if lay.dp_replicate > 1:
        e = step(
            {"parallel": c.parallel.model_copy(update={"dp_replicate": 1, "dp_shard": -1})},
            "parallel.dp_replicate=1 parallel.dp_shard=-1 (shard over every data rank)",
        )
        if e:
            return changes, e
    for ac_mode, sel, text in (
        ("selective", "op", "activation_checkpoint.mode=selective activation_checkpoint.selective=op"),
        ("full", 1, "activation_checkpoint.mode=full"),
    ):
        if c.activation_checkpoint.mode == "full":
            break
        update = {"mode": ac_mode, "selective": sel}
        changes[:] = [x for x in changes if not x.startswith("activation_checkpoint")]  # full replaces op
        if e := step({"activation_checkpoint": c.activation_checkpoint.model_copy(update=update)}, text):
            return changes, e
    while c.train.micro_batch_size > 1:
        if e := halve_micro():
            return changes, e
    return None


# -- text -------------------------------------------------------------------------------------
def gib(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GiB:,.2f} GiB" if n >= GiB or n == 0 else f"{n / 2**20:,.2f} MiB"


def breakdown(e: Estimate) -> str:
    width = max(len(k) for k in e.parts)
    lines = [f"  {k:<{width}}  {gib(v):>12}" for k, v in e.parts.items()]
    of = f"  of {gib(e.memory)}" if e.memory < 2**62 else ""
    lines.append(f"  {'total':<{width}}  {gib(e.total):>12}{of}")
    return "\n".join(lines)


def layout_text(lay: Layout) -> str:
    parts = [
        f"{d}={getattr(lay, d)}"
        for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
        if getattr(lay, d) > 1
    ]
    kind = "FSDP" if lay.fsdp else "DDP" if lay.dp > 1 else ""
    text = " ".join(parts) or "one device"
    text += f" ({kind})" if kind else ""
    return f"2 groups of {text}" if lay.roles > 1 else text


@dataclass
class Report:
    cfg: LadleConfig
    recipe: str
    target: Target
    own: Estimate
    fix: tuple[list[str], Estimate] | None
    ranked: list[Estimate]
    invalid: list[tuple[str, str]]

    def as_dict(self) -> dict:
        t = self.target
        return {
            "recipe": self.recipe,
            "target": {k: getattr(t, k) for k in t.__dataclass_fields__},
            "config_layout": self.own.as_dict(),
            "remedy": None
            if self.fix is None
            else {"changes": self.fix[0], "estimate": self.fix[1].as_dict()},
            "layouts": [e.as_dict() for e in self.ranked],
            "invalid": [{"layout": a, "why": b} for a, b in self.invalid],
        }

    def text(self, limit: int = 8) -> str:
        t, cfg, mc = self.target, self.cfg, self.cfg.model
        from ladle.models.llama import count_params

        ac = cfg.activation_checkpoint
        lines = [
            f"{t.devices} devices of {gib(t.memory)}, {t.per_node} a node; {t.peak_tflops:g} TFLOP/s peak at MFU "
            f"{t.mfu:g}; {t.intra_bw:g} GB/s within a node, {t.inter_bw:g} GB/s across",
            f"recipe {self.recipe}: {count_params(mc) / 1e9:,.2f}B parameters ({mc.family}, {mc.n_layers} layers, "
            f"dim {mc.dim}), sequence {cfg.data.seq_len}, micro-batch {cfg.train.micro_batch_size} x "
            f"{cfg.train.grad_accum_steps} accumulated, {cfg.precision.mode}, activation checkpointing "
            f"{ac.mode}{'' if ac.mode != 'selective' else f' ({ac.selective})'}",
            "",
            f"the config's layout, {layout_text(self.own.layout)}: "
            + (
                f"fits, {gib(self.own.total)} of {gib(t.memory)}"
                if self.own.fits
                else f"does NOT fit, {gib(self.own.total)} of {gib(t.memory)}"
            ),
            breakdown(self.own),
            f"  step {self.own.step_s:.2f} s (compute {self.own.compute_s:.2f} s, exposed communication "
            f"{self.own.comm_s:.2f} s)",
        ]
        if not self.own.fits:
            if self.fix:
                lines.append(f"  fits with: {'; '.join(self.fix[0])} -> {gib(self.fix[1].total)}")
            else:
                lines.append(
                    "  no change of precision, accumulation, sharding or checkpointing makes it fit here"
                )
        fit = [e for e in self.ranked if e.fits]
        lines += [
            "",
            f"layouts that fit ({len(fit)}), fastest first:" if fit else "no layout fits these devices",
        ]
        rows = [
            (
                layout_text(e.layout),
                gib(e.total),
                f"{e.step_s:.2f} s",
                f"{e.comm_s / e.step_s:.0%}",
                "; ".join(e.notes),
            )
            for e in fit[:limit]
        ]
        lines += _table(("layout", "memory", "step", "comm", "note"), rows)
        over = [e for e in self.ranked if not e.fits]
        if over:
            lines += ["", f"layouts that do not fit ({len(over)}), closest first:"]
            rows = [
                (layout_text(e.layout), gib(e.total), f"over by {gib(e.total - e.memory)}")
                for e in over[:limit]
            ]
            lines += _table(("layout", "memory", ""), rows)
        if self.invalid:
            lines += ["", f"layouts this model or config cannot take ({len(self.invalid)}):"]
            lines += [f"  {a}: {b}" for a, b in self.invalid[:limit]]
            if len(self.invalid) > limit:
                lines.append(f"  ... and {len(self.invalid) - limit} more (--json lists all)")
        return "\n".join(lines)


def _table(head, rows) -> list[str]:
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return [
        "  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]


def plan(cfg: LadleConfig, recipe: str, target: Target) -> Report:
    """The report for `cfg` on `target`: its own layout (a ConfigError if the devices cannot hold
    it), the remedy when it does not fit, and every layout ranked."""
    from ladle.parallel.mesh import check_layout

    groups = len(roles(cfg, recipe))
    own_lay = check_layout(cfg, target.devices, groups, "the separated placement")
    own = estimate(cfg, recipe, own_lay, target)
    fix = None if own.fits else remedy(cfg, recipe, own_lay, target)
    ranked, invalid = rank(
        cfg, recipe, target, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * own_lay.dp
    )
    return Report(cfg, recipe, target, own, fix, ranked, invalid)


# -- at launch and at an out-of-memory error ----------------------------------------------------
def device_target(cfg: LadleConfig, world: int, device) -> Target | None:
    """The devices a run will use, when their memory is known: `device.memory`, else what the
    accelerator reports (None on a CPU without `device.memory`)."""
    from ladle import device as dev

    if cfg.device.memory:
        memory = parse_size(cfg.device.memory, "device.memory")
    else:
        memory = dev.total_memory(device)
        if memory is None:
            return None
    cpu = device.type == "cpu"  # no accelerator context or collective buffers to set aside
    return Target(devices=world, memory=memory, per_node=world, cpu=cpu, runtime=0 if cpu else GiB)


def check_fits(cfg: LadleConfig, recipe: str, lay: Layout, device) -> None:
    """Refuses (ConfigError) a run whose planned peak exceeds the device's memory, with the
    figures, the first remedy that fits and the fastest layout of these devices that fits."""
    target = device_target(cfg, lay.world * lay.roles, device)
    if target is None:
        return
    est = estimate(cfg, recipe, lay, target)
    if est.fits:
        return
    source = "device.memory" if cfg.device.memory else "as the device reports"
    lines = [
        f"this run's planned peak memory, {gib(est.total)} a device, exceeds the {gib(target.memory)} of "
        f"one device ({source}) with layout {layout_text(lay)}:",
        breakdown(est),
    ]
    lines += remedy_lines(cfg, recipe, lay, target)
    lines.append(
        "`ladle plan` lists every layout; the estimate is tested against real runs, but if you know "
        "better, start anyway with `ladle run --no-memory-check` (device.memory_check=false)"
    )
    raise ConfigError("\n".join(lines))


def remedy_lines(cfg: LadleConfig, recipe: str, lay: Layout, target: Target) -> list[str]:
    fix = remedy(cfg, recipe, lay, target)
    lines = []
    if fix:
        lines.append(f"fits with: {'; '.join(fix[0])} -> {gib(fix[1].total)}")
    else:
        lines.append(
            "no change of precision, accumulation, sharding or checkpointing fits it (remedies in "
            "order: precision.mode=bf16-mixed, more train.grad_accum_steps with a smaller "
            "train.micro_batch_size, parallel.dp_shard over more ranks, activation_checkpoint.mode, "
            "a smaller train.micro_batch_size)"
        )
    if target.devices > 1:
        global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * lay.dp
        ranked, _ = rank(cfg, recipe, target, global_batch)
        fit = [e for e in ranked if e.fits]
        if fit:
            best = fit[0]
            lines.append(
                f"or, on these {target.devices} devices, the layout {layout_text(best.layout)} -> {gib(best.total)}"
                + (f" ({'; '.join(best.notes)})" if best.notes else "")
            )
    return lines


def oom_report(cfg: LadleConfig, recipe: str, lay: Layout, device, rank: int, step: int) -> str:
    """What an out-of-memory error gets: memory now, the planner's estimate, the remedies."""
    from ladle import device as dev

    allocated, reserved = dev.memory_now(device)
    now = f"allocated {gib(allocated)}" + (
        f", reserved {gib(reserved)}" if reserved is not None else " (resident)"
    )
    target = device_target(cfg, lay.world * lay.roles, device) or Target(
        devices=lay.world * lay.roles, memory=2**62, per_node=lay.world, cpu=True, runtime=0
    )
    est = estimate(cfg, recipe, lay, target)
    lines = [
        f"out of memory on rank {rank} in step {step}: {now}"
        + (f" of {gib(target.memory)}" if target.memory < 2**62 else "")
        + f"; the planner's estimate for layout {layout_text(lay)} is {gib(est.total)}:",
        breakdown(est),
    ]
    if target.memory < 2**62:
        lines += remedy_lines(cfg, recipe, lay, target)
    else:
        lines.append(
            "remedies, in order: precision.mode=bf16-mixed; more train.grad_accum_steps with a smaller "
            "train.micro_batch_size; parallel.dp_shard over more ranks; activation_checkpoint.mode=selective "
            "or full; a smaller train.micro_batch_size (set device.memory for figures)"
        )
    return "\n".join(lines)
