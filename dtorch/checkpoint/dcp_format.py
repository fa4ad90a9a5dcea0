"""torch.distributed.checkpoint's own format, as dtorch.checkpoint.load reads it: a directory with
`.metadata` (a pickle of torch's checkpoint Metadata classes) and `__<rank>_<n>.distcp` files, in
which each tensor chunk and each plain value is one torch.save record, at the offset the metadata
gives (torch's FileSystemWriter, as `torch.distributed.checkpoint.save(state, checkpoint_id=dir)`
writes it).

Read in this process, never by a worker: the metadata through an unpickler that builds only
torch's checkpoint metadata classes, torch.Size and dtypes (any other global is refused, so the
file cannot run code), and each record with torch.load(weights_only=True). Tensor bytes therefore
pass through this process: dtorch.checkpoint.load uploads each tensor onto its target's layout,
each worker receiving only its own block, as load_tensors(via_controller=True) does.
Not read: torch's safetensors flavour (HuggingFaceStorageWriter) and records written through
an extension (compression); each is refused naming the key.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .safetensors_header import CheckpointError

__all__ = ["METADATA_NAME", "DcpTensor", "DcpIndex", "is_dcp_checkpoint", "read_dcp_index", "read_dcp_tensor"]

METADATA_NAME = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_METADATA_MODULE, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                 "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class Record(NamedTuple):
    path: str            # the .distcp file, absolute
    offset: int          # where the torch.save record starts
    length: int


class DcpTensor(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    chunks: list         # [(Record, chunk offsets, chunk sizes)]
    saved_as: str = "torch.distributed.checkpoint"


class DcpIndex(NamedTuple):
    directory: str
    tensors: dict        # key -> DcpTensor
    values: Mapping      # key -> the plain value, read when asked for
    paths: dict          # key -> path, as torch flattened the state
    style = "dcp"        # how its keys were made (state_tree.flatten)


def is_dcp_checkpoint(directory) -> bool:
    return os.path.isfile(os.path.join(os.fspath(directory), METADATA_NAME))


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch's checkpoint metadata and nothing else: a global outside _ALLOWED (and torch's
    dtypes) is refused before it is looked up, so the file cannot run code."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch.distributed.checkpoint's metadata")


def read_dcp_index(directory) -> DcpIndex:
    """The checkpoint torch.distributed.checkpoint saved at `directory`: its keys, tensors' shapes,
    dtypes and chunks, and its plain values (read when asked for); CheckpointError otherwise."""
    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, METADATA_NAME)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        records = {(index.fqn, None if index.offset is None else tuple(index.offset)): _record(directory, info)
                   for index, info in metadata.storage_data.items()}
        tensors, values = {}, {}
        for key, entry in metadata.state_dict_metadata.items():
            if hasattr(entry, "chunks"):
                chunks = [(records[key, tuple(c.offsets)], tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
                tensors[key] = DcpTensor(tuple(entry.size), entry.properties.dtype, chunks)
            else:
                values[key] = records[key, None]
        planned = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
        paths = {key: tuple(planned.get(key, (key,))) for key in metadata.state_dict_metadata}
    except CheckpointError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint metadata file dtorch can read "
                              f"({type(error).__name__}: {error})") from None
    return DcpIndex(directory, tensors, _Values(values), paths)


def _record(directory: str, info) -> Record:
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{directory}: records written through torch's extensions "
                              f"({list(info.transform_descriptors)}) are not read by dtorch; save without them")
    path = os.path.join(directory, os.path.basename(info.relative_path))   # never outside the checkpoint
    return Record(path, int(info.offset), int(info.length))


def _read(record: Record, key: str):
    try:
        with open(record.path, "rb") as file:
            file.seek(record.offset)
            data = file.read(record.length)
        if len(data) != record.length:
            raise EOFError(f"{record.length} bytes expected at byte {record.offset}, {len(data)} there")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{record.path}: cannot read {key!r} of the torch.distributed.checkpoint checkpoint "
                              f"({type(error).__name__}: {error}); dtorch reads values torch.load(weights_only=True) "
                              "accepts (torch.serialization.add_safe_globals allows more)") from None


class _Values(Mapping):
    """key -> a plain value, each read from its record on first use."""

    def __init__(self, records: dict):
        self._records, self._read = records, {}

    def __getitem__(self, key: str):
        if key not in self._read:
            self._read[key] = _read(self._records[key], key)
        return self._read[key]

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


def read_dcp_tensor(saved: DcpTensor, key: str) -> torch.Tensor:
    """The whole tensor, assembled here from its chunks."""
    whole = torch.empty(saved.shape, dtype=saved.dtype)
    for record, offsets, sizes in saved.chunks:
        chunk = _read(record, key)
        if not isinstance(chunk, torch.Tensor) or tuple(chunk.shape) != sizes:
            found = f"shape {list(chunk.shape)}" if isinstance(chunk, torch.Tensor) else type(chunk).__name__
            raise CheckpointError(f"{record.path}: the chunk of {key!r} at {list(offsets)} should have shape "
                                  f"{list(sizes)}, it holds {found}")
        whole[tuple([slice(o, o + s) for o, s in zip(offsets, sizes)])] = chunk
    return whole
