"""What the planner says: `ladle plan`'s report (the estimate of the config's layout, the layouts
that fit), the refusal before launch (`check_fits`) and the out-of-memory report."""

from __future__ import annotations

from dataclasses import dataclass

from ladle.config.schema import LadleConfig
from ladle.errors import ConfigError
from ladle.parallel.mesh import Layout
from ladle.plan.estimate import Estimate, Target, estimate, roles
from ladle.plan.search import rank, remedy
from ladle.units import GiB, parse_size


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
