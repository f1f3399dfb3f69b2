"""The weight-name map between a Hugging Face checkpoint and ladle's state_dict: `model.` + our key,
per-expert tensors to and from the stacked experts, GLM's fused gate_up_proj as two row ranges,
DeepSeek-V3's multi-token prediction layers left aside; and the check that a set of tensors is
exactly what a config describes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ladle.config.schema import ModelConfig
from ladle.errors import CheckpointError
from ladle.models.hf.families import GLM, MOE_NAMES
from ladle.models.llama import Llama


def to_hf_name(name: str) -> str:
    return name if name.startswith(("lm_head.", "score.")) else "model." + name


_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.(gate\.weight|experts\.(gate_proj|up_proj|down_proj))")


FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.gate_up_proj\.weight)\[(\d*):(\d*)\]")


def hf_layout(cfg: ModelConfig) -> dict[str, tuple[str, int | None, tuple]]:
    """Every tensor of the family's HF checkpoint, in our module order: HF key -> (our state_dict
    key, expert index or None for the whole tensor, shape)."""
    with torch.device("meta"):
        ours = Llama(cfg).state_dict()
    layout = {}
    for name, t in ours.items():
        if cfg.family in GLM and name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            F = t.shape[0]  # HF's gate_up_proj holds gate's rows, then up's
            rows = f"[:{F}]" if ".gate_proj." in name else f"[{F}:]"
            layout[to_hf_name(name.rsplit(".", 2)[0]) + ".gate_up_proj.weight" + rows] = (
                name,
                None,
                tuple(t.shape),
            )
            continue
        m = _EXPERTS.fullmatch(name) if cfg.moe else None
        if m is None:
            layout[to_hf_name(name)] = (name, None, tuple(t.shape))
            continue
        block, names = MOE_NAMES[cfg.family]
        prefix = f"model.layers.{m[1]}.{block}"
        if m[3] is None:  # the router
            layout[f"{prefix}.gate.weight"] = (name, None, tuple(t.shape))
        else:
            for e in range(t.shape[0]):
                layout[f"{prefix}.experts.{e}.{names[m[3]]}.weight"] = (name, e, tuple(t.shape[1:]))
    return layout


def join_fused(tensors: dict) -> dict:
    """GLM's gate_up_proj from the row ranges `hf_layout` names (gate's rows, then up's)."""
    out = {}
    for name, t in tensors.items():
        m = FUSED.fullmatch(name)
        if m is None:
            out[name] = t
        elif m[2] == "":  # the first part: join it with the second, which follows it in the layout
            out[m[1]] = t
        else:
            out[m[1]] = torch.cat([out[m[1]], t])
    return out


def split_fused(header: dict) -> dict:
    """A GLM header's gate_up_proj entries as two entries for the row ranges `hf_layout` names,
    each a byte range of the fused tensor (rows are contiguous), so reads stay plain reads."""
    out = {}
    for name, info in header.items():
        if not name.endswith("mlp.gate_up_proj.weight") or len(info.get("shape", ())) != 2:
            out[name] = info
            continue
        rows, cols = info["shape"]
        start, end = info["data_offsets"]
        mid = start + (end - start) // 2
        half = rows // 2
        out[f"{name}[:{half}]"] = {**info, "shape": [half, cols], "data_offsets": [start, mid]}
        out[f"{name}[{half}:]"] = {**info, "shape": [rows - half, cols], "data_offsets": [mid, end]}
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mtp_layers(folder: Path, cfg: ModelConfig) -> range:
    """DeepSeek-V3's multi-token prediction layers (`num_nextn_predict_layers`, stored as the
    blocks after the last one: model.layers.61.* in V3), which ladle does not train yet: their
    block indices. Their tensors are left unread with a warning, as transformers leaves them; the
    model is the main one. Any other extra tensor is still refused by name."""
    n = 0
    if cfg.family == "deepseek_v3":
        try:
            n = int(json.loads((folder / "config.json").read_text()).get("num_nextn_predict_layers") or 0)
        except (OSError, ValueError, TypeError):
            n = 0
    return range(cfg.n_layers, cfg.n_layers + max(n, 0))


def check_names_shapes(
    found: dict[str, tuple], expected: dict[str, tuple], source: str, files: dict | None = None
) -> None:
    """CheckpointError listing missing, unexpected and mis-shaped tensors in `source` (name ->
    shape); `files` (name -> path) adds the file each unexpected or mis-shaped tensor came from."""

    def at(k):
        return f" in {Path(files[k]).name}" if files else ""

    missing = [k for k in expected if k not in found]
    unexpected = [k + at(k) for k in found if k not in expected]
    misshaped = [
        f"{k} {list(found[k])}{at(k)} (config expects {list(expected[k])})"
        for k in found
        if k in expected and tuple(found[k]) != tuple(expected[k])
    ]

    def fmt(names):
        return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    problems = []
    if missing:
        problems.append(f"missing tensors: {fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {fmt(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {fmt(misshaped)}")
    if problems:
        raise CheckpointError(
            f"{source} does not match the model config: " + "; ".join(problems) + ". "
            "Check that config.json belongs to these weights."
        )
