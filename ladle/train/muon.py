"""Muon: orthogonalised momentum for the blocks' matrices, AdamW for the rest, in one optimizer.

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", Moonlight, Liu et al. 2025) keeps
one momentum buffer per matrix, m = mu m + g, and steps along the Nesterov update g + mu m made
(nearly) orthogonal by five quintic Newton-Schulz iterations: every singular value pushed to about
1, the singular vectors kept. Moonlight's scale, 0.2 sqrt(max(rows, cols)), gives the update the
root-mean-square of a typical AdamW update, so AdamW's learning rate and (decoupled) weight decay
carry over unchanged.

Which parameter goes where (`is_muon`): a 2-D matrix of a transformer block is Muon's, and so is a
stacked experts' tensor (E, out, in), one matrix per expert, orthogonalised as a batch. Fused
matrices (latent attention's kv_a_proj_with_mqa, the latent and the rotary key together) are
orthogonalised whole, as Moonlight does. The embedding, the output head (tied or not), the norms,
the biases and the MoE router are AdamW's with the usual weight-decay rule: the router's rows are
the experts' scores, whose scale sets how sharply tokens are routed, which orthogonalising would
reset every step.

One optimizer holds both kinds of group (`use_muon`), so the schedule, the gradient clipping, the
checkpoint (DCP's optimizer state dict) and the loop are the same as AdamW's. The AdamW groups run
torch's own AdamW kernel on state named as AdamW's (`step`, `exp_avg`, `exp_avg_sq`).

Sharded weights (FSDP2's Shard(0), tensor parallel's Shard(0) / Shard(1), both at once): the
momentum stays sharded like the parameter, and Newton-Schulz, which needs the whole matrix, runs
on the update gathered over the parameter's mesh; every rank computes it (the same numbers) and
keeps its own shard. That is one all-gather and the whole iteration per matrix on every rank:
simple and exact; distributed Muon (each matrix orthogonalised on one rank, then scattered) would
divide the compute, and is the next step for large models.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adamw import adamw

from ladle.errors import ConfigError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic
NS_EPS = 1e-7


def is_muon(name: str, ndim: int) -> bool:
    """Whether Muon updates the parameter `name`: every block's parameter of 2 or more dimensions
    but the MoE router's. (Names as `named_parameters` gives them, wrappers' prefixes allowed.)"""
    parts = name.split(".")
    return "layers" in parts and ndim >= 2 and parts[-3:] != ["mlp", "gate", "weight"]


def check_orthogonalisable(name: str, p: torch.Tensor) -> None:
    """ConfigError naming a parameter Muon would update but cannot orthogonalise: neither a
    matrix nor a stack of experts' matrices, or laid out in a way that cannot be gathered whole."""
    stacked = p.ndim == 3 and "experts" in name.split(".")
    if p.ndim != 2 and not stacked:
        raise ConfigError(
            f"optim.name=muon cannot orthogonalise {name} of shape {tuple(p.shape)}: Muon takes a block's "
            "matrices (2-D) and stacked experts (E, out, in); use optim.name=adamw for this model"
        )
    if isinstance(p, DTensor):
        odd = [pl for pl in p.placements if not isinstance(pl, Shard | _StridedShard | Replicate)]
        if odd:
            raise ConfigError(
                f"optim.name=muon cannot orthogonalise {name}: its placement {odd[0]} on the mesh "
                f"{p.device_mesh.mesh_dim_names} cannot be gathered into the whole matrix; "
                "use optim.name=adamw for this layout"
            )


def muon_param_groups(model: torch.nn.Module, groups: list[dict], weight_decay: float) -> list[dict]:
    """Muon's group (every matrix decayed) before `groups` (AdamW's, by param_groups' rule) with
    Muon's parameters taken out of them."""
    muon = []
    for name, p in model.named_parameters():
        if p.requires_grad and is_muon(name, p.ndim):
            check_orthogonalisable(name, p)
            muon.append(p)
    ids = {id(p) for p in muon}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids], "use_muon": False} for g in groups]
    out = [{"params": muon, "use_muon": True, "weight_decay": weight_decay}] if muon else []
    return out + [g for g in rest if g["params"]]


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonal factor of g (..., rows, cols), approximately: the quintic iteration on
    g / ||g||_F, on the wide orientation (the Gram matrix is the smaller one)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def orthogonalise(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz of the whole matrix; a DTensor is gathered, and each rank keeps its shard of
    the result (cut locally: every rank holds the same whole matrix), unless it is a stack of
    experts split by expert."""
    if not isinstance(u, DTensor):
        return newton_schulz(u, steps, dtype)
    if u.ndim == 3 and all(
        (type(pl) is Shard and pl.dim == 0) or isinstance(pl, Replicate) for pl in u.placements
    ):
        # a stack of experts split by expert (expert parallel, FSDP's dim 0): each rank holds
        # whole experts and orthogonalises its own, no collective
        local = newton_schulz(u.to_local(), steps, dtype)
        return DTensor.from_local(local, u.device_mesh, u.placements, shape=u.shape, stride=u.stride())
    whole = newton_schulz(u.full_tensor(), steps, dtype)
    return distribute_tensor(whole, u.device_mesh, u.placements, src_data_rank=None)


def lr_scale(shape: torch.Size, adjust: str) -> float:
    """The factor on lr for an orthogonalised update of a (rows, cols) matrix."""
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":  # Moonlight: RMS 0.2, AdamW's typical update RMS
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # Keller Jordan's


class Muon(torch.optim.Optimizer):
    """Groups with `use_muon` are Muon's, the others AdamW's (`betas`, `eps`, `foreach`, `fused`)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "float32",
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            use_muon=False,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            adjust_lr=adjust_lr,
            betas=betas,
            eps=eps,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        dtype = getattr(torch, group["ns_dtype"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            u = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            o = orthogonalise(u, group["ns_steps"], dtype)
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * lr_scale(p.shape, group["adjust_lr"]))

    def _adamw(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW initialises it
                on = p.device if group["fused"] else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=on)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=group["foreach"],
            fused=group["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
