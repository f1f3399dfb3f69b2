"""Writing a Hugging Face folder of the family's architecture (config.json, generation config,
safetensors shards, the tokenizer's files) that transformers loads, atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ladle.config.schema import ModelConfig
from ladle.errors import CheckpointError
from ladle.models.hf.config import hf_config
from ladle.models.hf.families import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from ladle.models.hf.names import check_names_shapes, hf_layout, join_fused
from ladle.models.llama import Llama


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int, dtype) -> list[list[str]]:
    """Group names, in order, into shards of at most max_bytes (a bigger tensor gets a shard alone)."""
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * (dtype or t.dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir,
    *,
    tokenizer_dir=None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    bos_id=None,
    eos_id=None,
    pad_id=None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face folder of the family's architecture that
    `transformers.AutoModelForCausalLM.from_pretrained` loads.

    state_dict uses our names (`Llama.state_dict()`); dtype=None keeps each tensor's dtype. Everything is
    written to a temp folder beside out_dir and renamed at the end, so a failure leaves nothing behind.
    An existing non-empty out_dir is an error unless overwrite=True.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists and is not empty; remove it or pick another folder")
    tok_files = []
    if tokenizer_dir is not None:
        tok_files = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json to copy into the export")

    # Check names and shapes against the model the config describes before writing anything.
    with torch.device("meta"):
        expected = {k: tuple(t.shape) for k, t in Llama(cfg).state_dict().items()}
    sd = {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    check_names_shapes({k: tuple(v.shape) for k, v in sd.items()}, expected, "state_dict")
    tensors = {  # HF names, our module order; experts one tensor each
        hf: sd[ours] if e is None else sd[ours][e] for hf, (ours, e, _) in hf_layout(cfg).items()
    }
    tensors = join_fused(tensors)

    out_dtype = dtype or next(iter(tensors.values())).dtype
    config = hf_config(
        cfg, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, torch_dtype=DTYPE_NAMES.get(out_dtype, "float32")
    )
    generation = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
    if pad_id is not None:
        generation["pad_token_id"] = pad_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    file_mode = tmp.stat().st_mode & 0o666  # what the umask gives a new file
    try:
        shards = _shards(tensors, max_shard_bytes, dtype)
        weight_map, total = {}, 0
        for i, names in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            # Convert one shard at a time so peak CPU memory is about one shard, not the whole model.
            part = {n: tensors[n].detach().to("cpu", dtype or tensors[n].dtype).contiguous() for n in names}
            save_file(part, tmp / fname, metadata={"format": "pt"})
            os.chmod(tmp / fname, file_mode)  # safetensors creates 0600; share like the other files
            total += sum(t.numel() * t.element_size() for t in part.values())
            weight_map.update(dict.fromkeys(names, fname))
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        if tok_files and not (tmp / "tokenizer_config.json").exists():
            # Without it AutoTokenizer would pick LlamaTokenizerFast, which adds its own special tokens.
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len}
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        if out_dir.exists():  # empty, or overwrite=True: swap, then drop the old one
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
