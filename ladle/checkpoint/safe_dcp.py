"""Reading a DCP checkpoint without running code from it.

DCP's `FileSystemReader.read_metadata` unpickles `.metadata` with `pickle.load`, and its
`DefaultLoadPlanner.load_bytes` reads every non-tensor entry with `torch.load(weights_only=False)`:
either lets a crafted checkpoint run whatever its pickle asks for. Here `.metadata` is read by an
unpickler that admits only the classes DCP writes there (and builds no state onto a class), and
the non-tensor entries go through `torch.load(weights_only=True)` first. Tensor data DCP already
reads with `weights_only=True`. Every ladle path that reads a checkpoint calls `load` below.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from ladle.errors import CheckpointError

METADATA = ".metadata"

# What DCP's metadata pickle holds: its dataclasses, the storage info of the file system writer,
# tensor sizes, dtypes and layouts, and the checkpoint's path.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from a fixed table
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be guarded
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which DCP metadata never holds")

    def _build(self):
        # BUILD onto a class object would set attributes of that class in this process.
        if isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError("it sets attributes of a class")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def read_metadata(path: str | Path) -> Metadata:
    """A checkpoint's `.metadata`, or a CheckpointError naming the file when it is anything else."""
    f = Path(path) / METADATA
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except FileNotFoundError as e:
        raise CheckpointError(f"{f} is missing: not a complete DCP checkpoint") from e
    except Exception as e:  # a refused global, a truncated or garbled file
        raise CheckpointError(
            f"{f} is not DCP checkpoint metadata ({type(e).__name__}: {e}); refused without running "
            "anything from it. The checkpoint is damaged or was crafted: use another one"
        ) from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{f} holds a {type(md).__name__}, not DCP checkpoint metadata; refused")
    return md


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # Refuses anything but tensors and plain containers before DCP's own (unrestricted) read.
        why = _not_plain(value)
        if why:
            raise CheckpointError(f"its entry {read_item.dest_index.fqn!r} {why}")
        value.seek(0)
        super().load_bytes(read_item, value)


def _not_plain(value: io.BytesIO) -> str | None:
    """Why a non-tensor entry is refused, or None when it holds plain data only."""
    try:
        torch.load(value, weights_only=True)
    except Exception as e:
        lines = str(e).splitlines() or [type(e).__name__]
        why = next((ln for ln in lines if "GLOBAL" in ln), lines[0])
        return f"is not plain data ({why}); refused without running anything from it (damaged or crafted)"
    return None


def check(path: str | Path) -> dict[str, str]:
    """Problems, by file, of a checkpoint's DCP part read without running anything: `.metadata`
    must be DCP metadata, and every non-tensor entry (the optimizer's hyperparameters) plain data."""
    path = Path(path)
    try:
        md = read_metadata(path)
    except CheckpointError as e:
        return {METADATA: str(e).removeprefix(f"{path / METADATA} ")}
    problems = {}
    for index, info in (md.storage_data or {}).items():
        if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        name = PurePosixPath(info.relative_path)
        if name.is_absolute() or ".." in name.parts:
            problems[METADATA] = f"names a file outside the checkpoint: {info.relative_path!r}"
            continue
        if getattr(info, "transform_descriptors", None):  # compressed: checked when loaded
            continue
        with open(path / name, "rb") as f:
            f.seek(info.offset)
            why = _not_plain(io.BytesIO(f.read(info.length)))
        if why:
            problems[info.relative_path] = f"its entry {index.fqn!r} {why}"
    return problems


def load(state: dict, path: str | Path) -> None:
    """dcp.load into `state` (in place), from a checkpoint folder, running nothing from it; every
    failure is a CheckpointError naming the checkpoint."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        read_metadata(path)  # a refusal here, before DCP's logs, names the file; DCP reads it again
    try:
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafePlanner())
    except CheckpointException as e:  # a BaseException, holding each failed rank's exception
        err = next(iter(e.failures.values()))[0]
        while isinstance(err, CheckpointException):
            err = next(iter(err.failures.values()))[0]
        if isinstance(err, CheckpointError):
            raise CheckpointError(f"the checkpoint {path}: {err}") from None
        raise CheckpointError(f"could not load the checkpoint {path}: {type(err).__name__}: {err}") from None
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"could not load the checkpoint {path}: {type(e).__name__}: {e}") from e
