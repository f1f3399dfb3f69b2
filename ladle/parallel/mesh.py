"""The parallel layout: degrees checked against the world and the model, and one DeviceMesh.

Mesh dimensions, outermost first, as torchtitan orders them: `pp, dp_replicate, dp_shard, cp, tp`
(tensor parallel innermost, so its heavy collectives stay between neighbouring ranks, on one
machine). Data parallelism is `dp_replicate x dp_shard`: every data-parallel rank reads its own
slice of each global batch; the ranks of one TP (or PP, CP) group read the same samples. The
ranks of a CP group then split each sample's tokens (ladle/parallel/cp.py), so weights are
sharded, and gradients averaged, over `dp_shard x cp` (torchtitan's `dp_shard_cp`).

With the RL recipes' separated placement (`ppo.placement: separated`) the world is `roles` = 2
groups of ranks, each laid out as `parallel.*` says: the mesh gets an outermost `role` dimension,
every other dimension (and so every group above) stays within a role, and `role` pairs rank i of
one group with rank i of the other (ladle/rl/placement.py).

`check_layout` runs before any process starts (`ladle run --nproc`, `ladle launch slurm`,
`ladle validate --nproc N`) and again in each process; it refuses what does not divide, with the
arithmetic in the message.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from ladle.config import LadleConfig
from ladle.device import pick_device
from ladle.errors import ConfigError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# With expert parallelism the experts are split over `ep` of the dp_shard ranks (torchtitan's
# layout): dp_shard is built as (dp_shard_mod_ep, ep) and flattened back for everything else.
EP_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    roles: int = 1  # groups of ranks laid out alike (separated placement: 2)

    @property
    def world(self) -> int:
        """The ranks of one group (all of them without a separated placement)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 whenever weights are sharded over data ranks, or data parallelism meets another
        degree (DDP composes with nothing else); plain DDP for pure replication."""
        return self.dp_shard * self.cp > 1 or (self.dp_replicate > 1 and self.world > self.dp_replicate)

    @property
    def sharded(self) -> bool:
        """Some parameter is split over ranks, or held by one stage only (then the model is built
        on the meta device)."""
        return self.fsdp or self.tp > 1 or self.ep > 1 or self.pp > 1

    def describe(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in (*DIMS, "ep") if getattr(self, d) > 1]
        kind = "FSDP2" if self.fsdp else "DDP" if self.dp > 1 else None
        text = (", ".join(parts) or "one process") + (f" ({kind})" if kind else "")
        return f"{self.roles} groups of {text}" if self.roles > 1 else text


def resolve_layout(cfg: LadleConfig, world: int) -> Layout:
    p = cfg.parallel
    others = p.dp_replicate * p.tp * p.pp * p.cp
    fixed = f"dp_replicate={p.dp_replicate} x tp={p.tp} x pp={p.pp} x cp={p.cp} = {others}"
    if p.dp_shard == -1:
        if world % others:
            raise ConfigError(
                f"parallel: {fixed} does not divide the world size {world}; change the degrees or --nproc"
            )
        shard = world // others
    else:
        shard = p.dp_shard
        if others * shard != world:
            raise ConfigError(
                f"parallel: {fixed} x dp_shard={shard} = {others * shard}, but the world size is {world}; "
                "set parallel.dp_shard=-1 to take the rest, or change --nproc"
            )
    return Layout(p.dp_replicate, shard, p.tp, p.pp, p.cp, p.ep)


def role_world(cfg: LadleConfig, world: int, roles: int, why: str) -> int:
    """The ranks of each of `roles` groups laid out by `parallel.*` in a world of `world`, or a
    ConfigError naming how many ranks the placement needs (`why`: what the groups hold)."""
    p = cfg.parallel
    others = p.dp_replicate * p.tp * p.pp * p.cp
    if p.dp_shard != -1:  # fixed degrees: exactly roles x their product
        need = roles * others * p.dp_shard
        if world != need:
            raise ConfigError(
                f"{why}: it needs {need} ranks, {roles} groups of parallel.dp_replicate x dp_shard x tp x pp x cp "
                f"= {need // roles}, but {world} were launched; launch {need} (--nproc) or change parallel.*"
            )
    elif world < roles * others or world % (roles * others):
        raise ConfigError(
            f"{why}: it needs a multiple of {roles * others} ranks, {roles} groups of a multiple of "
            f"parallel.dp_replicate x tp x pp x cp = {others}, but {world} were launched; launch "
            f"{roles * others} (--nproc) or more"
        )
    return world // roles


def check_layout(cfg: LadleConfig, world: int, roles: int = 1, why: str = "") -> Layout:
    """The layout for `world` processes (in `roles` groups laid out alike, holding `why`: see
    `role_world`), or a ConfigError that says what to change."""
    if roles > 1:
        world = role_world(cfg, world, roles, why)
    lay = replace(resolve_layout(cfg, world), roles=roles)
    errors = []
    if cfg.model.mla is not None and lay.cp > 1:
        errors.append(
            "cp > 1 with model.mla (DeepSeek-V3's latent attention) is not supported yet; "
            "use dp_shard (FSDP), tp, pp and ep"
        )
    errors += _tp_errors(cfg, lay) if lay.tp > 1 else []
    errors += _async_tp_errors(cfg, lay) if cfg.parallel.async_tp else []
    errors += _pp_errors(cfg, lay) if lay.pp > 1 else []
    errors += _cp_errors(cfg, lay) if lay.cp > 1 else []
    errors += _ep_errors(cfg, lay) if lay.ep > 1 else []
    if cfg.lora is not None and cfg.lora.quantize_base != "none" and lay.sharded:
        errors.append(
            "lora.quantize_base=nf4 (QLoRA) runs on one device or with dp_replicate (DDP); sharding an NF4 "
            "base (FSDP, TP, PP) is not supported yet: use plain LoRA there"
        )
    if roles > 1 and lay.ep > 1:
        errors.append("ep > 1 in a separated placement is not supported yet")
    if cfg.parallel.cpu_offload and not lay.fsdp:
        errors.append("parallel.cpu_offload needs FSDP (dp_shard > 1)")
    if cfg.parallel.cpu_offload and cfg.optim.name == "muon":  # its gathers would run on host tensors
        errors.append(
            "optim.name=muon cannot take parallel.cpu_offload (it gathers each update on the device); drop one"
        )
    if errors:
        raise ConfigError(f"parallel layout {lay.describe()} for world size {world}: " + "; ".join(errors))
    return lay


def _divides(name: str, degree: int, field: str, value: int) -> list[str]:
    return [f"{name}={degree} does not divide model.{field}={value}"] if value % degree else []


def _tp_errors(cfg: LadleConfig, lay: Layout) -> list[str]:
    """What tensor (and sequence) parallelism needs of the model and the data."""
    m, errors = cfg.model, []
    errors += _divides("tp", lay.tp, "n_heads", m.n_heads)
    errors += _divides("tp", lay.tp, "n_kv_heads", m.kv_heads)
    if not m.moe:
        errors += _divides("tp", lay.tp, "ffn_dim", m.ffn_dim)
    errors += _divides("tp", lay.tp, "vocab_size", m.vocab_size)
    if cfg.data.seq_len % lay.tp and lay.cp == 1:  # sequence parallel splits every sample's tokens
        errors.append(f"tp={lay.tp} does not divide data.seq_len={cfg.data.seq_len} (sequence parallel)")
    if m.moe and m.moe.n_shared_experts:  # split like a dense MLP
        errors += _divides(
            "tp", lay.tp, "moe.ffn_dim x moe.n_shared_experts", m.moe.ffn_dim * m.moe.n_shared_experts
        )
    if m.moe and lay.ep > 1:
        errors.append(
            f"tp={lay.tp} with ep={lay.ep} is not supported yet (each TP rank routes its own tokens, "
            "and expert parallelism would need their gradients summed over both); use one of them"
        )
    return errors


def _async_tp_errors(cfg: LadleConfig, lay: Layout) -> list[str]:
    """What asynchronous TP needs: tp > 1, compiled blocks, CUDA."""
    errors = []
    if lay.tp == 1:
        errors.append("parallel.async_tp needs parallel.tp > 1")
    if not cfg.train.compile:
        errors.append(
            "parallel.async_tp is an inductor pass over the compiled blocks; set train.compile=true"
        )
    kind = pick_device(cfg.train.device).type
    if kind != "cuda":
        errors.append(
            f"parallel.async_tp needs CUDA (symmetric memory), but this run's device is {kind}; "
            "set parallel.async_tp=false"
        )
    return errors


def _pp_errors(cfg: LadleConfig, lay: Layout) -> list[str]:
    """What pipeline parallelism needs: a layer for every stage, enough microbatches."""
    m, errors = cfg.model, []
    from ladle.parallel.pp import STAGES_PER_RANK

    p = cfg.parallel
    stages = lay.pp * STAGES_PER_RANK[p.pp_schedule]
    if p.pp_split:
        ok = len(p.pp_split) == stages - 1 and all(
            a < b for a, b in zip([0, *p.pp_split], [*p.pp_split, m.n_layers], strict=True)
        )
        if not ok:
            errors.append(
                f"parallel.pp_split={p.pp_split} must be {stages - 1} increasing layer indices between 0 "
                f"and model.n_layers={m.n_layers} ({stages} stages: pp={lay.pp} x "
                f"{STAGES_PER_RANK[p.pp_schedule]} per rank for {p.pp_schedule}), leaving no stage empty"
            )
    elif m.n_layers < stages:
        errors.append(
            f"pp={lay.pp} x {STAGES_PER_RANK[p.pp_schedule]} stages per rank ({p.pp_schedule}) = {stages} "
            f"stages for model.n_layers={m.n_layers} would leave a stage empty"
        )
    if cfg.train.grad_accum_steps < lay.pp:
        errors.append(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} (the pipeline's microbatches) must be "
            f"at least pp={lay.pp}"
        )
    if m.tie_embeddings:
        errors.append("pp > 1 with model.tie_embeddings=true is not supported (the head is on another stage)")
    if cfg.precision.mode == "fp16-mixed":
        errors.append(
            "pp > 1 with precision.mode=fp16-mixed is not supported (the schedule's backward is not loss-scaled); use bf16-mixed"
        )
    return errors


def _cp_errors(cfg: LadleConfig, lay: Layout) -> list[str]:
    """What context parallelism needs of the sequence length and the other dimensions."""
    m, errors = cfg.model, []
    T = cfg.data.seq_len
    if T % (2 * lay.cp):  # two chunks per rank (load balancing, ladle/parallel/cp.py)
        errors.append(f"2 x cp={2 * lay.cp} does not divide data.seq_len={T}")
    elif lay.tp > 1 and (T // lay.cp) % lay.tp:
        errors.append(
            f"tp={lay.tp} does not divide data.seq_len / cp = {T // lay.cp} (sequence parallel of each shard)"
        )
    if lay.pp > 1:
        errors.append("cp > 1 with pp > 1 is not supported yet")
    if lay.ep > 1:
        errors.append("cp > 1 with ep > 1 is not supported yet")
    if cfg.parallel.cp_attention == "ring" and m.sliding_window is not None:
        errors.append(
            "parallel.cp_attention=ring has no sliding window (model.sliding_window); use cp_attention=allgather"
        )
    if cfg.parallel.cp_attention == "ring" and cfg.data.document_mask:
        errors.append(
            "parallel.cp_attention=ring has no document mask; set data.document_mask=false or use "
            "cp_attention=allgather"
        )
    return errors


def _ep_errors(cfg: LadleConfig, lay: Layout) -> list[str]:
    """What expert parallelism needs: an MoE model whose experts split over dp_shard."""
    m, errors = cfg.model, []
    if not m.moe:
        errors.append(f"ep={lay.ep} on a dense model: expert parallelism needs model.moe")
    else:
        errors += _divides("ep", lay.ep, "moe.n_experts", m.moe.n_experts)
    if lay.dp_shard % lay.ep:
        errors.append(
            f"ep={lay.ep} must divide dp_shard={lay.dp_shard} (the experts are split over those ranks)"
        )
    return errors


class Parallel:
    """The layout of this process: its mesh (None alone), its data-parallel rank and group (which
    samples it reads), its loss group (the ranks whose tokens differ: data ranks x cp), the
    sequence sharding of context parallelism, and the loss context (tensor parallel computes the
    loss on vocab-sharded logits). With `layout.roles` > 1 also its `role` (0: the group with
    global rank 0), `group` (its role's ranks; None: the world) and `pair_group` (this rank and
    the ranks at its place in the other groups); every other group stays within the role."""

    def __init__(self, layout: Layout, device: torch.device, cp_attention: str = "allgather"):
        self.layout = layout
        self.mesh = None
        self.dp_rank, self.dp_size, self.dp_group = 0, 1, None
        self.loss_size, self.loss_group = 1, None
        self.cp = None
        self.shared_group, self.shared_rank, self.shared_leader = None, 0, 0  # see `shared`
        self.role, self.group, self.pair_group = 0, None, None
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(layout, d) for d in DIMS)
        if layout.roles > 1:
            full = init_device_mesh(device.type, (layout.roles, *shape), mesh_dim_names=("role", *DIMS))
            self.role = full.get_coordinate()[0]
            self.pair_group = full["role"].get_group()
            self.group = full[DIMS]._flatten("members").get_group()
        if layout.world == 1:
            return

        # _flatten is private, but stable since torch 2.4 (torchtitan builds its meshes with it).
        if layout.ep > 1:
            sizes = {**vars(layout), "dp_shard_mod_ep": layout.dp_shard // layout.ep}
            self.mesh = init_device_mesh(
                device.type, tuple(sizes[d] for d in EP_DIMS), mesh_dim_names=EP_DIMS
            )
            self.mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
            dp = self.mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        elif layout.roles > 1:  # slices by the names in DIMS keep to this rank's role
            self.mesh = full
            dp = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        else:
            self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=DIMS)
            dp = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.dp_rank, self.dp_size, self.dp_group = dp.get_local_rank(), dp.size(), dp.get_group()
        self.loss_size, self.loss_group = self.dp_size, self.dp_group
        if layout.cp > 1:
            from ladle.parallel.cp import ContextParallel

            self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP's mesh
            loss = self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self.loss_size, self.loss_group = loss.size(), loss.get_group()
            self.cp = ContextParallel(self.mesh["cp"], cp_attention)
        shared = self.shared_dims
        if shared:
            m = (
                self.mesh[shared[0]]
                if len(shared) == 1
                else self.mesh[tuple(shared)]._flatten("batch_shared")
            )
            self.shared_group, self.shared_rank = m.get_group(), m.get_local_rank()
            self.shared_leader = torch.distributed.get_global_rank(self.shared_group, 0)

    @property
    def sequence_sharded(self) -> bool:
        """A forward pass's positions are split over ranks (TP's sequence parallelism): a head
        cannot pick positions, so the RL recipes run theirs at every position."""
        return self.layout.tp > 1

    @property
    def data_group(self):
        """The data-parallel ranks as a group for collectives over the rows they hold (None: the
        world); in a separated placement never wider than this rank's role."""
        return self.dp_group if self.dp_group is not None else self.group

    @property
    def shared_dims(self) -> list[str]:
        """The degrees whose ranks train on the same samples (their group reads once)."""
        return [d for d in ("pp", "cp", "tp") if getattr(self.layout, d) > 1]

    @property
    def shared(self) -> str | None:
        """Those degrees for messages ('tp', 'pp x tp', ...), or None."""
        return " x ".join(self.shared_dims) or None

    def shard_sequence(self, batch: dict) -> dict:
        """This rank's part of each sample under context parallelism (else the batch itself)."""
        return self.cp.shard(batch) if self.cp is not None else batch

    def all_reduce_loss(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """Sum (or `op`) over the ranks whose tokens differ (token counts, loss sums)."""
        if self.loss_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM, group=self.loss_group)
        return t

    def submesh(self, *names: str):
        return self.mesh[names] if len(names) > 1 else self.mesh[names[0]]

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group() if self.layout.pp > 1 else None

    def all_reduce_pp(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """Sum (or `op`) over the pipeline stages (only the last one has the loss)."""
        if self.layout.pp > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM, group=self.pp_group)
        return t

    def loss_context(self):
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()
