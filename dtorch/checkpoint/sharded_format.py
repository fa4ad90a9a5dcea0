"""The sharded checkpoint format that dtorch.checkpoint.save writes and load reads back onto any
layout (docs/design/checkpoint.md, "Sharded checkpoints"): a directory of safetensors files, one per
writing rank and SaveShard, plus `checkpoint.json`, written last:

    {"format": "dtorch-sharded", "version": 1,
     "tensors": {key: {"path": [...], "shape": [...], "dtype": "float32", "saved_as": "S(0), R on (2, 2)",
                       "chunks": [{"file": "__0_0.safetensors", "offsets": [...], "shape": [...],
                                   "crc32": 2417155146}, ...]}},
     "values": {key: {"path": [...], "value": <encoded>}},
     "crc32": <of the rest of the index, canonical JSON>}

A key is the state's path joined with dots ("optim.state.0.exp_avg"); each file holds its chunks
under their keys. The chunks of a tensor tile it; each chunk's crc32 (of its bytes in the file)
is checked where it is read, and the index's own crc32 covers its every other field (plain values,
offsets, shapes): an index edited after the save is refused (one without them, from before them,
loads unchecked). This
module encodes plain values as JSON and reads the index (and, for a reader without workers, whole
tensors); state_tree.py turns a state into keys. No commands are sent from here.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..runtime.worker.file_shards import NO_CHECKSUM, ChecksumError, read_region, recorded_checksums, safetensors_code
from ..ops.tensor_meta import is_local_tensor
from ..runtime.protocol import dtype_from_name
from .safetensors_header import CheckpointError, read_header_and_metadata

__all__ = ["INDEX_NAME", "FORMAT", "FORMAT_VERSION", "Chunk", "SavedTensor", "SavedIndex", "encode_value",
           "decode_value", "read_index", "read_whole", "check_savable_dtype", "PLAIN_TENSOR_ELEMENTS"]

INDEX_NAME = "checkpoint.json"
FORMAT, FORMAT_VERSION = "dtorch-sharded", 1
_PLAIN = (type(None), bool, int, float, str)
PLAIN_TENSOR_ELEMENTS = 1 << 16   # a torch tensor this small is a plain value, stored in the index


class Chunk(NamedTuple):
    path: str            # the safetensors file, absolute
    data_offset: int     # where its bytes start in the file
    dtype: torch.dtype   # as stored
    offset: tuple        # where the chunk sits in the global tensor
    shape: tuple
    checksum: int        # the crc32 of its bytes; NO_CHECKSUM where the index records none


class SavedTensor(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    chunks: list         # [Chunk], tiling the tensor
    saved_as: str        # the layout it was saved from, for messages


class SavedIndex(NamedTuple):
    directory: str
    tensors: dict        # key -> SavedTensor
    values: dict         # key -> the decoded plain value
    paths: dict          # key -> path (tensors and values), to rebuild the nesting
    style = "dtorch"     # how its keys were made (state_tree.flatten)


def read_whole(saved: SavedTensor, key: str, *, verify: bool = True) -> torch.Tensor:
    """A saved tensor read whole in this process (no worker), each chunk's checksum checked unless
    verify=False; CheckpointError for a chunk that is not as saved or a file cut short."""
    chunks = saved.chunks if verify else [chunk._replace(checksum=NO_CHECKSUM) for chunk in saved.chunks]
    try:
        whole = read_region(chunks, [0] * len(saved.shape), saved.shape, saved.dtype, f"tensor {key!r}")
    except (ChecksumError, EOFError) as error:   # the file changed since its header was read, or is damaged
        raise CheckpointError(str(error)) from None
    return whole.to(saved.dtype)


# --- plain values as JSON -------------------------------------------------------------------------
def encode_value(value, key: str):
    """JSON for a plain value: None, bool, int, float, str, lists, tuples, dicts of them, and small
    torch tensors the controller holds (an optimizer's step count, a scheduler's lr). Tuples and
    dicts whose keys are not all strings are tagged so that they come back as they were."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [encode_value(v, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, f"{key}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(type(k) is str and not k.startswith("__") for k in value):
            return {k: encode_value(v, f"{key}.{k}") for k, v in value.items()}
        return {"__items__": [[encode_value(k, key), encode_value(v, f"{key}.{k}")] for k, v in value.items()]}
    if is_local_tensor(value) and value.numel() <= PLAIN_TENSOR_ELEMENTS:
        return {"__torch__": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "values": value.detach().cpu().reshape(-1).tolist()}
    raise CheckpointError(f"{key!r}: cannot save a {type(value).__name__} ({str(value)[:60]}); a checkpoint holds "
                          "DTensors and plain values (None, bool, int, float, str, small torch tensors, and "
                          "lists, tuples and dicts of them)")


def decode_value(data):
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple([decode_value(v) for v in data["__tuple__"]])
    if "__items__" in data:
        return {decode_value(k): decode_value(v) for k, v in data["__items__"]}
    if "__torch__" in data:
        return torch.tensor(data["values"], dtype=dtype_from_name(data["__torch__"])).reshape(data["shape"])
    return {k: decode_value(v) for k, v in data.items()}


def check_savable_dtype(key: str, dtype: torch.dtype) -> None:
    if safetensors_code(dtype) is None:
        raise CheckpointError(f"{key!r}: dtype {dtype} has no safetensors code; convert it first (x.to(...))")


# --- reading the index ----------------------------------------------------------------------------
def read_index(directory, *, verify: bool = True) -> SavedIndex:
    """The checkpoint at `directory`, its index and every file's header checked (files present,
    not truncated, chunk shapes and dtypes as the index says, and with `verify` the checksums a
    file records as the index does: a file swapped with another, or replaced, is refused here);
    CheckpointError otherwise."""
    directory = os.path.abspath(os.fspath(directory))
    index_path = os.path.join(directory, INDEX_NAME)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not os.path.isfile(index_path):
        raise CheckpointError(f"{directory}: no {INDEX_NAME}, so not a dtorch.checkpoint.save directory (a save "
                              "writes it last: a save that did not finish never leaves one at the target)")
    try:
        with open(index_path) as file:
            index = json.load(file)
        if index.get("format") != FORMAT:
            raise CheckpointError(f"{index_path}: format {index.get('format')!r}, not {FORMAT!r}")
        if index.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{index_path}: format version {index.get('version')!r}; this dtorch reads "
                                  f"version {FORMAT_VERSION}")
        if verify:
            _check_index_checksum(index_path, index)
        headers: dict = {}
        tensors = {key: _saved_tensor(directory, key, entry, headers, verify)
                   for key, entry in index["tensors"].items()}
        values = {key: decode_value(entry["value"]) for key, entry in index["values"].items()}
        paths = {key: tuple(entry["path"]) for part in ("tensors", "values") for key, entry in index[part].items()}
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_path}: a damaged index ({type(error).__name__}: {error})") from None
    return SavedIndex(directory, tensors, values, paths)


def index_checksum(index: dict) -> int:
    """The crc32 of the index without its own "crc32", as canonical JSON (sorted keys, no spaces)."""
    rest = {key: value for key, value in index.items() if key != "crc32"}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _check_index_checksum(index_path: str, index: dict) -> None:
    recorded = index.get("crc32")
    if recorded is not None and recorded != index_checksum(index):
        raise CheckpointError(f"{index_path}: the index does not match the crc32 it was saved with: it was edited or "
                              "damaged after the save (a plain value, a chunk's offsets or shape). "
                              "dtorch.checkpoint.load(..., verify=False) loads it unchecked")


def _saved_tensor(directory: str, key: str, entry: dict, headers: dict, verify: bool) -> SavedTensor:
    shape, dtype = tuple(entry["shape"]), dtype_from_name(entry["dtype"])
    chunks = [_chunk(directory, key, dtype, chunk, headers, verify) for chunk in entry["chunks"]]
    problem = tiling_problem(shape, [(chunk.offset, chunk.shape) for chunk in chunks])
    if problem:
        raise CheckpointError(f"{os.path.join(directory, INDEX_NAME)}: the chunks of {key!r} do not tile its shape "
                              f"{list(shape)}: {problem}")
    return SavedTensor(shape, dtype, chunks, entry.get("saved_as", "?"))


def tiling_problem(shape: tuple, boxes: list) -> str | None:
    """None when the (offset, shape) boxes cover `shape` exactly once, else what is wrong. Counting
    elements is not enough: a chunk moved onto another leaves a gap the count does not see, and a
    load would give the gap's uninitialized memory. Exact: the boxes' own boundaries cut each dim
    into a grid, and every grid cell must be covered once (about one cell per chunk for a save's
    shards)."""
    for offset, size in boxes:
        if len(offset) != len(shape) or len(size) != len(shape):
            return f"a chunk at {list(offset)} of shape {list(size)} has another number of dims"
        if any(o < 0 or o + s > whole for o, s, whole in zip(offset, size, shape)):
            return f"the chunk at {list(offset)} of shape {list(size)} reaches outside it"
    if math.prod(shape) == 0:
        return None
    cuts = [sorted({0, whole, *(o[d] for o, _ in boxes), *(o[d] + z[d] for o, z in boxes)})
            for d, whole in enumerate(shape)]
    cell = [{point: i for i, point in enumerate(c)} for c in cuts]
    covered = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for offset, size in boxes:
        covered[tuple([slice(at[o], at[o + z]) for at, o, z in zip(cell, offset, size)])] += 1
    if (covered > 1).any():
        at = [c[i] for c, i in zip(cuts, (covered > 1).nonzero()[0].tolist())]
        return f"two chunks overlap at {at}"
    if (covered == 0).any():
        at = [c[i] for c, i in zip(cuts, (covered == 0).nonzero()[0].tolist())]
        return f"no chunk holds the elements at {at}"
    return None


def _chunk(directory: str, key: str, dtype: torch.dtype, chunk: dict, headers: dict, verify: bool) -> Chunk:
    path = os.path.join(directory, os.path.basename(chunk["file"]))
    if path not in headers:
        if not os.path.isfile(path):
            raise CheckpointError(f"{directory}: {chunk['file']} is missing (it holds part of {key!r})")
        tensors, metadata = read_header_and_metadata(path)
        headers[path] = tensors, recorded_checksums(metadata)
    tensors, checksums = headers[path]
    stored = tensors.get(key)
    shape = tuple(chunk["shape"])
    if stored is None or stored.shape != shape or stored.dtype != dtype:
        found = "nothing" if stored is None else f"{stored.dtype} {list(stored.shape)}"
        raise CheckpointError(f"{path}: the index says it holds {key!r} as {dtype} {list(shape)}, it holds {found}")
    crc = chunk.get("crc32", NO_CHECKSUM)
    if type(crc) is not int or not (crc == NO_CHECKSUM or 0 <= crc < 1 << 32):
        raise TypeError(f"the crc32 of a chunk of {key!r} is {crc!r}")
    if verify and crc != NO_CHECKSUM and checksums.get(key, crc) != crc:
        raise CheckpointError(f"{path}: the index records crc32 {crc:#010x} for the chunk of {key!r} at offsets "
                              f"{chunk['offsets']}, the file records {checksums[key]:#010x} for it: not the file this "
                              "save wrote (swapped with another, or replaced?). load(..., verify=False) reads it "
                              "anyway")
    return Chunk(path, stored.data_offset, dtype, tuple(chunk["offsets"]), shape, crc)
