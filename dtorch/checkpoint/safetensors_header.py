"""What a safetensors checkpoint holds, read from its headers only (no tensor bytes, no
`safetensors` package): each tensor's file, dtype, shape and byte offset.

A `.safetensors` file is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data,
row-major and little-endian; offsets count from the end of the header. A transformers checkpoint
directory holds `model.safetensors`, or `model.safetensors.index.json` whose "weight_map" names the
shard file of every tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import torch

from ..errors import DTorchError
from ..runtime.worker.file_shards import SAFETENSORS_DTYPES

__all__ = ["StoredTensor", "CheckpointError", "read_header", "read_header_and_metadata", "read_checkpoint",
           "checkpoint_files", "SINGLE_FILE", "INDEX_FILE", "first_names"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_LIMIT = 100 << 20   # the format's own cap on a header: a larger length means a damaged file

DTYPES = SAFETENSORS_DTYPES   # code -> torch dtype; the workers' writer (runtime.file_shards) shares it


class CheckpointError(DTorchError, ValueError):
    """A checkpoint that cannot be read, or does not fit the tensors it should load into."""


class StoredTensor(NamedTuple):
    path: str            # the file holding its bytes
    name: str
    dtype: torch.dtype
    shape: tuple
    data_offset: int     # where its bytes start in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def read_header(path: str) -> dict[str, StoredTensor]:
    """The tensors of one .safetensors file, checked against the file's size (a truncated file is
    refused here, before any worker reads it)."""
    return read_header_and_metadata(path)[0]


def read_header_and_metadata(path: str) -> tuple[dict[str, StoredTensor], dict]:
    """read_header's tensors, and the file's "__metadata__" ({} if it has none)."""
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {len(prefix)} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > HEADER_LIMIT:
            raise CheckpointError(f"{path}: header length {length} bytes; not a safetensors file, or damaged")
        raw = file.read(length)
        size = os.fstat(file.fileno()).st_size
    if len(raw) < length:
        raise CheckpointError(f"{path}: the file ends inside its {length}-byte header (truncated?)")
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise CheckpointError(f"{path}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    start = 8 + length
    metadata = header.get("__metadata__")
    tensors = {name: _stored(path, name, entry, start, size) for name, entry in header.items()
               if name != "__metadata__"}
    return tensors, metadata if isinstance(metadata, dict) else {}


def _stored(path: str, name: str, entry, start: int, size: int) -> StoredTensor:
    try:
        code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for {name!r}: {str(entry)[:100]}") from None
    if code not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {code!r}, which this torch cannot hold "
                              f"(known: {', '.join(DTYPES)})")
    if not all(type(s) is int and s >= 0 for s in shape) or not (type(begin) is type(end) is int and 0 <= begin <= end):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {list(shape)} and offsets {[begin, end]}")
    stored = StoredTensor(path, name, DTYPES[code], shape, start + begin)
    if end - begin != stored.nbytes:
        raise CheckpointError(f"{path}: tensor {name!r} of shape {list(shape)} and dtype {code} needs "
                              f"{stored.nbytes} bytes, its offsets span {end - begin}")
    if start + end > size:
        raise CheckpointError(f"{path}: the file has {size} bytes, but tensor {name!r} ends at byte {start + end} "
                              "(truncated, or still being written?)")
    return stored


def checkpoint_files(path: str) -> tuple[str, dict[str, str] | None]:
    """(the file, None) for a .safetensors file or a directory with model.safetensors; (the index
    file, its weight_map with shard paths made absolute) for an index or a directory with one."""
    if os.path.isdir(path):
        for candidate in (INDEX_FILE, SINGLE_FILE):
            if os.path.isfile(os.path.join(path, candidate)):
                return checkpoint_files(os.path.join(path, candidate))
        raise CheckpointError(f"{path}: a directory with neither {SINGLE_FILE} nor {INDEX_FILE}")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    if not path.endswith(".json"):
        return path, None
    with open(path) as file:
        try:
            weight_map = json.load(file)["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{path}: not a safetensors index (a JSON object with a \"weight_map\")") from None
    folder = os.path.dirname(os.path.abspath(path))
    return path, {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


def read_checkpoint(path: str) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint (a file, an index, or a directory holding one), by name; only
    headers are read. Paths are absolute: workers resolve them as the controller does."""
    file, weight_map = checkpoint_files(os.path.abspath(path))
    if weight_map is None:
        return read_header(file)
    headers = {shard: read_header(shard) for shard in sorted(set(weight_map.values()))}
    missing = [name for name, shard in weight_map.items() if name not in headers[shard]]
    if missing:
        raise CheckpointError(f"{file}: the index maps {len(missing)} tensor(s) to shards that do not hold them: "
                              f"{first_names(missing)}")
    return {name: headers[shard][name] for name, shard in weight_map.items()}


def first_names(names, count: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
