"""Reading a Hugging Face folder's safetensors: the headers checked against the config first (every
missing, unexpected or mis-shaped tensor named), then plain positional reads straight into the
model's tensors, on a few threads, without mmap (peak memory: the model plus a few tensors)."""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ladle.config.schema import ModelConfig
from ladle.errors import CheckpointError
from ladle.models.hf.config import read_hf_config
from ladle.models.hf.families import GLM, INDEX_FILE, SINGLE_FILE
from ladle.models.hf.names import _LAYER, check_names_shapes, hf_layout, mtp_layers, split_fused
from ladle.models.llama import Llama


def weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{folder / INDEX_FILE}: not a valid safetensors index ({e})") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{folder / INDEX_FILE} lists shards that are not in {folder}: {absent}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    hint = (
        " (pytorch_model.bin is not supported: re-save with safe_serialization)"
        if any(folder.glob("pytorch_model*.bin"))
        else ""
    )
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} with the weights{hint}")


def load_hf(path, *, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[Llama, ModelConfig]:
    """Load a Hugging Face folder of a supported architecture into our Llama on `device` in `dtype`.

    Tensors are read one at a time with plain file reads straight into the materialised model, so
    peak memory is the model plus one tensor (see load_hf_weights). Tied checkpoints that still
    carry lm_head.weight are accepted (the copy is ignored, as transformers does).
    """
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.init_buffers()
    load_hf_weights(model, path)
    return model, cfg


def load_hf_weights(model: Llama, path) -> list[str]:
    """Fill `model` (its own device and dtype) from the safetensors of a Hugging Face folder, tensor
    by tensor; every missing, unexpected or mis-shaped tensor is reported by name first. Returns
    the names left as they were: a score head the folder (a causal LM's) does not hold."""
    weights = HFWeights(path, model.cfg)
    params = model.state_dict()
    weights.read_into(params)
    return [n for n in params if n not in weights.held]


class HFWeights:
    """The safetensors of a Hugging Face folder, checked against a model config once (headers
    only: every missing, unexpected or mis-shaped tensor is reported by HF name before anything is
    read), then read into any subset of our parameters: all of them (`load_hf_weights`), or one
    block at a time into full tensors that a sharded model takes its shards from."""

    def __init__(self, path, cfg: ModelConfig):
        folder = Path(path)
        self.files = weight_files(folder)
        self.layout = hf_layout(cfg)
        self.headers = {f: _read_header(f) for f in self.files}
        if cfg.family in GLM:
            self.headers = {f: (start, split_fused(h)) for f, (start, h) in self.headers.items()}
        found, self.where = {}, {}
        # A reward model started from a causal LM: its head is not in the files (it starts from
        # the seeded init, `holds`), and the LM head in them is not read.
        skip = "lm_head.weight" if cfg.tie_embeddings or cfg.head == "score" else None
        mtp, unread = mtp_layers(folder, cfg), []
        for f, (_, header) in self.headers.items():
            for hf_key, info in header.items():
                layer = _LAYER.match(hf_key)
                if layer and int(layer[1]) in mtp:
                    unread.append(hf_key)
                elif hf_key != skip:
                    found[hf_key] = tuple(info["shape"])
                    self.where[hf_key] = f
        if unread:
            warnings.warn(
                f"{folder}: the multi-token prediction layer ({len(unread)} tensors, "
                f"model.layers.{mtp.start}.* on) is not loaded: ladle trains the main model only, as "
                "transformers loads it",
                stacklevel=2,
            )
        expected = {k: shape for k, (_, _, shape) in self.layout.items()}
        if cfg.head == "score" and "score.weight" not in found:
            del expected["score.weight"]
        check_names_shapes(found, expected, str(folder), self.where)
        self.held = {ours for hf, (ours, _, _) in self.layout.items() if hf in self.where}

    def holds(self, names) -> bool:
        """Whether the files hold every one of these tensors (our names)."""
        return all(n in self.held for n in names)

    def read_into(self, params: dict[str, torch.Tensor]) -> None:
        """Read the tensors of `params` (our names; CPU or accelerator tensors) from the files.

        Plain positional reads (os.preadv) straight into each tensor when the dtype matches (else
        through one temporary per tensor, cast by copy_). No mmap, so the file's pages never count
        as this process's memory: peak RSS is the model plus a few tensors. Most of the time is
        first-touching freshly allocated memory, which the kernel does in parallel, so the reads
        run on a few threads in chunks of READ_CHUNK bytes."""
        jobs = []
        fds = {f: os.open(f, os.O_RDONLY) for f in self.files}
        try:
            for f, (data_start, header) in self.headers.items():
                for hf_key, info in header.items():
                    ours, e, _ = self.layout.get(hf_key, (None, None, None))
                    if self.where.get(hf_key) == f and ours in params:
                        dst = params[ours] if e is None else params[ours][e]
                        jobs += _read_jobs(fds[f], f, data_start, info, dst)
            with torch.no_grad(), ThreadPoolExecutor(min(READ_THREADS, os.cpu_count() or 1)) as pool:
                for _ in pool.map(lambda job: job(), jobs):
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)


READ_THREADS = 4


READ_CHUNK = 64 << 20


def _read_header(f: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {dtype, shape, data_offsets}}) of a safetensors file, checked
    against the file's size so a truncated or corrupt file is named before anything is read."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            if info.get("dtype") not in _ST_DTYPES:
                raise CheckpointError(
                    f"{f}: tensor {name} has dtype {info.get('dtype')!r}, which ladle does not load; "
                    f"supported: {', '.join(_ST_DTYPES)}"
                )
            start, end = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * _ST_DTYPES[info["dtype"]].itemsize
            if end - start != nbytes or 8 + n + end > size:
                raise ValueError(f"tensor {name} lies outside the file or disagrees with its shape")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{f}: cannot read safetensors file ({e}); it is truncated or corrupt: re-export or re-download it"
        ) from e
    return 8 + n, header


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_jobs(fd: int, f: Path, data_start: int, info: dict, dst: torch.Tensor) -> list:
    """Callables that read one safetensors entry (little-endian, as this machine) into `dst`:
    READ_CHUNK-sized pieces straight into it when it is a contiguous CPU tensor of the file's
    dtype, else one read into a temporary and a cast copy."""
    dtype = _ST_DTYPES[info["dtype"]]
    start, end = (data_start + o for o in info["data_offsets"])  # sizes checked by _read_header

    def read(view: memoryview, offset: int) -> None:
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:
            raise CheckpointError(f"{f}: cannot read tensor data ({e}): re-export or re-download it") from e
        if n != len(view):
            raise CheckpointError(
                f"{f}: the file ends inside a tensor; it is truncated or corrupt: re-export or re-download it"
            )

    if dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous():
        raw = memoryview(dst.view(-1).view(torch.uint8).numpy())
        return [
            lambda o=o: read(raw[o : o + READ_CHUNK], start + o) for o in range(0, end - start, READ_CHUNK)
        ]

    def convert() -> None:
        tmp = torch.empty(info["shape"], dtype=dtype)
        read(memoryview(tmp.view(-1).view(torch.uint8).numpy()), start)
        dst.copy_(tmp)

    return [convert]
