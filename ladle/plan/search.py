"""The layouts of a number of devices (tensor parallel within a node), ranked by their estimated
step time among those that fit, and the first change that makes a layout fit (`remedy`), in the
order users should try them."""

from __future__ import annotations

from ladle.config.schema import LadleConfig
from ladle.errors import ConfigError
from ladle.parallel.mesh import Layout
from ladle.plan.estimate import Estimate, Target, estimate, roles


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


# The degrees a recipe refuses before launch (ladle/recipes: the RL recipes' rollouts run under
# neither PP nor CP; distillation's divergence over the whole vocabulary not under TP either).
NOT_UNDER = {"grpo": ("pp", "cp"), "ppo": ("pp", "cp"), "distill": ("pp", "cp", "tp")}


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
        degree = {"tp": tp, "pp": pp, "cp": cp}
        refused = [d for d in NOT_UNDER.get(recipe, ()) if degree[d] > 1]
        if refused:  # what the recipe refuses before launch (its check_layout)
            out.append((c, None, f"{recipe} does not run under {refused[0].upper()} yet"))
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
