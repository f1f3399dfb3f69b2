"""Starting a sharded model without ever holding it whole on a device.

The model is built on the meta device (no memory), laid out (TP, EP, FSDP) there, and only then
given real storage: each rank allocates its own shards. The weights are then filled one
top-level part at a time (the embedding, each block, the final norm, the head): that part is
materialised whole in host memory, initialised (or read from a Hugging Face folder), and
`set_model_state_dict` copies each rank's shards out of it. Peak host memory is the largest part
(one block, or the embedding), not the model.

The parts are initialised in the same order and with the same random draws as
`Llama.init_weights` on a whole model (`init_modules`), so a sharded run starts from exactly the
weights of a single-process run on the CPU with the same seed: the layouts' tests rely on it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ladle.config.schema import ModelConfig
from ladle.models.llama import Llama, init_modules


def materialize(
    model: nn.Module,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    hf_path=None,
    fill: bool = True,
) -> None:
    """Storage for this rank's shards, filled from `hf_path` or the seeded init (fill=False: left
    empty, for a checkpoint to overwrite)."""
    for part in getattr(model, "parts", [model]):  # a pipeline stage's RankModel: its parts
        part.to_empty(device=device)
        part.init_buffers()
    if not fill:
        return
    here = set(model.state_dict())
    with torch.device("meta"):
        ghost = Llama(cfg)  # pristine names and shapes, no storage
    weights = None
    if hf_path is not None:
        from ladle.models.hf import HFWeights

        weights = HFWeights(hf_path, cfg)  # every name and shape checked before anything is read
    options = StateDictOptions(full_state_dict=True, strict=False)
    for prefix, part in _parts(ghost):
        full = copy.deepcopy(part).to_empty(device="cpu")
        names = {f"{prefix}.{k}": v for k, v in full.state_dict().items()}
        if weights is None or not weights.holds(names):  # a reward model's new score head
            init_modules(full, cfg, prefix)
        elif any(k in here for k in names):
            weights.read_into(names)
        # Every rank draws every part's init (the same random stream as one process), but takes
        # only what it holds (pipeline stages hold some parts).
        mine = {k: v.to(dtype) for k, v in names.items() if k in here}
        if mine:
            set_model_state_dict(model, mine, options=options)
        del full, names


def _parts(ghost: Llama):
    """(name, module) of the top-level parts in named_modules order (that of the init's draws)."""
    yield "embed_tokens", ghost.embed_tokens
    for i, block in enumerate(ghost.layers):
        yield f"layers.{i}", block
    yield "norm", ghost.norm
    if ghost.cfg.head == "score":
        yield "score", ghost.score
    elif not ghost.cfg.tie_embeddings:
        yield "lm_head", ghost.lm_head
