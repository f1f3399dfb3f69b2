"""Builds a model for a recipe, laid out for the run, with one call per model:

    policy = build_laid_out(cfg, par, device)  # trained: adapters, AC, compile
    reference = build_laid_out(cfg, par, device, trainable=False)  # frozen: same layout, none of them

Weights come from `model.init_from` (a Hugging Face folder or a ladle checkpoint, resharded into
this layout) or the seeded initialisation, so a frozen reference starts equal to the policy.
Under pipeline parallelism the result holds this rank's stages and the schedule that runs them.
A resumed policy's trained weights come from the run's checkpoint afterwards (the loop loads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ladle.checkpoint.catalogue import read_config
from ladle.checkpoint.dcp import load_model_weights, resolve_checkpoint
from ladle.config import LadleConfig
from ladle.models.hf import is_hf_folder, load_hf_weights, read_hf_config
from ladle.models.llama import Llama
from ladle.models.llama import build_model as build_plain
from ladle.models.lora import init_adapters
from ladle.models.nf4 import quantize_linears
from ladle.parallel.init import materialize
from ladle.parallel.mesh import Parallel
from ladle.parallel.parallelize import Apply, build_pipeline, parallelize


@dataclass
class Built:
    model: nn.Module  # laid out; under PP this rank's stages (RankModel)
    pipeline: object = None  # ladle.parallel.pp.Pipeline under PP
    source: str | None = None  # where the weights came from (None: the seeded init)
    notes: list[str] = field(default_factory=list)  # events worth logging (QLoRA's memory)


def applied(cfg: LadleConfig, trainable: bool = True) -> Apply:
    """What the run config asks to apply to a trained model, or to a frozen one."""
    what = Apply(
        parallel=cfg.parallel,
        precision=cfg.precision.mode,
        lora=cfg.lora,
        ac=cfg.activation_checkpoint,
        compile=cfg.train.compile,
        seed=cfg.seed,
    )
    return what if trainable else what.frozen()


def build_laid_out(
    cfg: LadleConfig, par: Parallel, device: torch.device, *, trainable: bool = True, load: bool = True
) -> Built:
    """A model of `cfg.model` laid out by `par`. trainable=False: no adapters, no activation
    checkpointing, every parameter frozen, in eval mode. load=False: leave the weights to a
    resume (an adapter run still loads its frozen base: its checkpoints hold the adapters only)."""
    what = applied(cfg, trainable)
    param_dtype = torch.bfloat16 if cfg.precision.mode == "bf16" else torch.float32
    adapters = what.lora is not None
    init = cfg.model.init_from if load or adapters else None
    hf = init if init and is_hf_folder(init) else None
    ckpt = resolve_checkpoint(init) if init and not hf else None  # a ladle checkpoint's weights only
    built = Built(model=None, source=str(ckpt or hf) if init else None)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, and for every copy
    if par.layout.sharded:
        # Laid out on the meta device, then each rank allocates and fills only its shards.
        with torch.device("meta"):
            model = Llama(cfg.model)
        model.to(dtype=param_dtype).requires_grad_(trainable)  # frozen before any wrapper sees it
        if par.layout.pp > 1:  # this rank's stages, each laid out like a model of its own
            model, built.pipeline = build_pipeline(
                model, par, device, what, cfg.train.grad_accum_steps, cfg.data.seq_len
            )
        else:
            model = parallelize(model, par, device, what)
        materialize(
            model, cfg.model, device, param_dtype, hf_path=hf, fill=(load or adapters) and ckpt is None
        )
        if ckpt:  # DCP reshards any layout's checkpoint into this one
            load_model_weights(ckpt, model, base_only=adapters)
        if adapters:  # the adapters' init needs the base in place (DoRA: |W|)
            for part in getattr(model, "parts", [model]):
                init_adapters(part, cfg.seed)
    else:
        # From init_from (or a checkpoint) every tensor is overwritten: skip the random init then.
        model = build_plain(cfg.model, device=device, dtype=param_dtype, init=not init).requires_grad_(
            trainable
        )
        if hf:
            load_hf_weights(model, hf)
        elif ckpt:
            load_model_weights(ckpt, model)
        if adapters and cfg.lora.quantize_base == "nf4":
            nf4, full = quantize_linears(model)
            built.notes.append(
                f"QLoRA: the frozen base's block linears take {nf4 / 2**20:,.2f} MiB in NF4, "
                f"{full / 2**20:,.2f} MiB in {param_dtype} ({full / nf4:.1f}x less)"
            )
        model = parallelize(model, par, device, what)  # adapters added (and initialised) here
    if init and fresh_head(cfg):
        _init_score(model, cfg, param_dtype)
        built.notes.append(f"score head: new (normal, std {cfg.model.init_std}); {init} is a causal LM")
    if not trainable:
        model.eval()
    built.model = model
    return built


def fresh_head(cfg: LadleConfig) -> bool:
    """A reward model (`model.head: score`) started from a causal LM: its head is not in init_from."""
    init = cfg.model.init_from
    if cfg.model.head != "score" or not init:
        return False
    if is_hf_folder(init):
        return read_hf_config(init).head != "score"
    return read_config(resolve_checkpoint(init))["model"].get("head", "lm") != "score"


def _init_score(model: nn.Module, cfg: LadleConfig, dtype: torch.dtype) -> None:
    """The new score head, drawn from its own seeded stream (the same in every layout), as
    transformers initialises it: normal(0, init_std)."""
    g = torch.Generator().manual_seed(cfg.seed)
    w = torch.empty(1, cfg.model.dim).normal_(0.0, cfg.model.init_std, generator=g)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {"score.weight": w.to(dtype)}, options=options)
