"""A worker reads its own block of a tensor stored row-major in a file (a checkpoint shard), and
only the bytes of that block: the controller never touches them. For sharded checkpoints
(dtorch.checkpoint.save / load) a worker also writes its blocks as a safetensors file, and reads
its block back from the parts of saved chunks that overlap it (bottom of this file).

A block of a row-major tensor is a grid of contiguous runs: the dims after the last one the
block cuts are whole, so each run spans the cut dim's length times their size. Runs far apart
(Shard(0), or Shard(1) of a wide matrix) are read one `preadv` each straight into the result; runs
closer than GAP_LIMIT bytes (Shard(1) of a narrow matrix: many tiny runs) are read as the range
covering them, in CHUNK_BYTES pieces, and the block is copied out of it: there a system call per
run costs more than reading the gap. The crossover, measured from the page cache, is between
768 B and 2 KiB gaps (docs/design/checkpoint.md has the numbers).

Every chunk a worker writes carries its crc32 (zlib's: the fastest checksum or hash in the
standard library on this project's machine; docs/design/checkpoint.md, "Checksums", has the figures),
recorded in the file's own metadata; the controller copies it into the checkpoint's index. A read
checks it where the bytes are read (read_region, bottom of this file).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct
import zlib

import torch

from ...spec.placements import narrow_to_box

__all__ = ["read_block", "block_runs", "GAP_LIMIT", "CHUNK_BYTES", "SAFETENSORS_DTYPES", "safetensors_code",
           "shard_file_name", "write_safetensors", "read_region", "overlap", "checksum", "recorded_checksums",
           "ChecksumError", "NO_CHECKSUM"]

GAP_LIMIT = 1024            # bytes between runs below which the covering range is read instead
CHUNK_BYTES = 64 << 20      # the most covering-range bytes held at once (a scratch buffer)


def block_runs(shape, offset, box):
    """Groups of runs, in row-major order of the block: (first element, runs, stride, run
    length), all in elements of the stored tensor. A group's runs are `stride` apart."""
    if any(length == 0 for length in box):
        return
    strides = _row_major_strides(shape)
    cut = max((d for d in range(len(shape)) if box[d] != shape[d]), default=0)
    run = box[cut] * strides[cut] if shape else 1
    if cut == 0:
        yield sum(o * s for o, s in zip(offset, strides)), 1, run, run
        return
    inner = offset[cut - 1] * strides[cut - 1] + offset[cut] * strides[cut]
    for outer in itertools.product(*[range(o, o + b) for o, b in zip(offset[:cut - 1], box[:cut - 1])]):
        start = sum(i * s for i, s in zip(outer, strides)) + inner
        yield start, box[cut - 1], strides[cut - 1], run


def read_block(path: str, data_offset: int, stored_dtype: torch.dtype, shape, offset, box,
               what: str) -> torch.Tensor:
    """The block (offset, box) of the row-major tensor of `shape` whose bytes start at
    `data_offset` in `path`, as a CPU tensor of `stored_dtype`. `what` names the tensor and the
    rank in errors (FileNotFoundError, EOFError for a file that ends too early)."""
    out = torch.empty(tuple(box), dtype=stored_dtype)
    itemsize = out.element_size()
    destination = _bytes_of(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: checkpoint file {path} does not exist on this host") from None
    try:
        _check_size(fd, path, data_offset + math.prod(shape) * itemsize, what)
        written = 0
        for start, count, stride, run in block_runs(tuple(shape), tuple(offset), tuple(box)):
            group = destination[written:written + count * run * itemsize]
            position = data_offset + start * itemsize
            if count > 1 and (stride - run) * itemsize < GAP_LIMIT:
                _read_covering(fd, position, count, stride, run, out.dtype, group, path, what)
            else:
                for index in range(count):
                    _read_exact(fd, group[index * run * itemsize:(index + 1) * run * itemsize],
                                position + index * stride * itemsize, path, what)
            written += len(group)
    finally:
        os.close(fd)
    return out


def _read_covering(fd, position, count, stride, run, dtype, group, path, what) -> None:
    """Runs close together: read the range covering up to CHUNK_BYTES of them at once, keep the runs."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_chunk = max(1, CHUNK_BYTES // (stride * itemsize))
    scratch = torch.empty(((per_chunk - 1) * stride + run) if count > per_chunk else ((count - 1) * stride + run),
                          dtype=dtype)
    for first in range(0, count, per_chunk):
        runs = min(per_chunk, count - first)
        span = (runs - 1) * stride + run
        _read_exact(fd, _bytes_of(scratch)[:span * itemsize], position + first * stride * itemsize, path, what)
        kept = scratch.as_strided((runs, run), (stride, 1))
        target = torch.frombuffer(group[first * run * itemsize:(first + runs) * run * itemsize], dtype=dtype)
        target.view(runs, run).copy_(kept)


def _read_exact(fd, buffer, position: int, path: str, what: str) -> None:
    view = memoryview(buffer)
    while len(view):
        got = os.preadv(fd, [view], position)
        if got == 0:
            raise EOFError(f"{what}: checkpoint file {path} ends at byte {position}, inside the tensor's data "
                           "(truncated, or changed while loading?)")
        view, position = view[got:], position + got


def _check_size(fd, path: str, end: int, what: str) -> None:
    size = os.fstat(fd).st_size
    if size < end:
        raise EOFError(f"{what}: checkpoint file {path} has {size} bytes, but the tensor's data ends at byte "
                       f"{end} (truncated, or a different file than the controller read?)")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (bfloat16 and bool included)."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(bytearray())


def _row_major_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


# --- sharded checkpoints: writing each rank's blocks, reading a block back from saved chunks -------
# safetensors dtype codes -> torch dtypes this torch has (the float8 and unsigned ones are recent)
_DTYPE_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
                "F8_E5M2": "float8_e5m2", "C64": "complex64"}
SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in _DTYPE_CODES.items() if hasattr(torch, name)}
_CODE_OF = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
_HEADER_ALIGN = 8    # the format pads its header so that the data starts aligned


def safetensors_code(dtype: torch.dtype) -> str | None:
    """The safetensors name of `dtype` (F32, BF16, ...), None where the format has none."""
    return _CODE_OF.get(dtype)


def shard_file_name(rank: int, file_index: int) -> str:
    """The file one rank writes for one SaveShard (the controller names it the same way in the index)."""
    return f"__{rank}_{file_index}.safetensors"


def write_safetensors(path: str, tensors: list) -> dict[str, int]:
    """Write [(name, CPU tensor), ...] as a new safetensors file and fsync it: when this returns,
    the bytes are on disk (the controller publishes the checkpoint only after every rank got here).
    Each tensor's crc32 goes into the file's metadata (`crc32:<name>`, where the controller reads
    it for the index) and is returned, name -> crc32. The file must not exist: a rank never
    overwrites another save's file."""
    header, position, raws, crcs = {}, 0, [], {}
    for name, tensor in tensors:
        raws.append(_bytes_of(tensor.contiguous()))
        crcs[name] = checksum(raws[-1])   # over the very bytes written below
        header[name] = {"dtype": _CODE_OF[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [position, position + len(raws[-1])]}
        position += len(raws[-1])
    # "format": what transformers' and safetensors' loaders expect; metadata values are strings
    header["__metadata__"] = {"format": "pt", **{_CRC_KEY + name: str(crc) for name, crc in crcs.items()}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _HEADER_ALIGN)
    with open(path, "xb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        for data in raws:
            file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return crcs


# --- checksums: computed where the bytes are written, checked where they are read -----------------
NO_CHECKSUM = -1     # a chunk without one (a checkpoint from before them, or load(verify=False))
_CRC_KEY = "crc32:"  # the file's metadata key of a tensor's checksum, before its name


class ChecksumError(ValueError):
    """A chunk's bytes are not those that were saved (a flipped bit, a file replaced or swapped)."""


def checksum(data) -> int:
    """The crc32 of a bytes-like object (zlib's, which releases the GIL on large buffers)."""
    return zlib.crc32(data)


def recorded_checksums(metadata: dict) -> dict[str, int]:
    """name -> crc32 of the tensors a file's metadata (its header's "__metadata__") records."""
    return {key[len(_CRC_KEY):]: int(value) for key, value in metadata.items()
            if key.startswith(_CRC_KEY) and isinstance(value, str) and value.isdigit()}


def _file_checksum(fd, position: int, nbytes: int, path: str, what: str) -> int:
    """The crc32 of `nbytes` of a file from `position`, read CHUNK_BYTES at a time."""
    scratch, crc = bytearray(min(nbytes, CHUNK_BYTES)), 0
    for start in range(0, nbytes, CHUNK_BYTES):
        view = memoryview(scratch)[:min(CHUNK_BYTES, nbytes - start)]
        _read_exact(fd, view, position + start, path, what)
        crc = zlib.crc32(view, crc)
    return crc


def overlap(offset_a, box_a, offset_b, box_b):
    """(offset, box) of the intersection of two blocks of one tensor, None if they do not meet."""
    starts = [max(a, b) for a, b in zip(offset_a, offset_b)]
    ends = [min(a + la, b + lb) for a, la, b, lb in zip(offset_a, box_a, offset_b, box_b)]
    if any(end <= start for start, end in zip(starts, ends)):
        return None
    return starts, [end - start for start, end in zip(starts, ends)]


def read_region(chunks, offset, box, dtype: torch.dtype, what: str) -> torch.Tensor:
    """The block (offset, box) of a tensor saved as `chunks`, blocks that tile it:
    ((path, data_offset, stored_dtype, chunk_offset, chunk_shape, crc32), ...). Only the bytes of
    the chunks' parts inside the block are read. A block that one chunk covers comes back in the
    stored dtype, as read; otherwise in `dtype`.

    Each chunk with a crc32 (not NO_CHECKSUM) is checked by the ranks whose block holds its first
    element: a rank that reads a chunk whole checks the bytes it read; one that needs only part of
    it reads the rest too (a load onto another layout, once per chunk across the ranks). A
    mismatch raises ChecksumError naming the file, the tensor and the chunk."""
    offset, box = list(offset), list(box)
    if any(length == 0 for length in box):
        return torch.empty(box, dtype=dtype)
    parts = []
    for chunk in chunks:
        met = overlap(offset, box, chunk[3], chunk[4])
        if met is not None:
            parts.append((chunk, *met))
    covered = sum(math.prod(length) for _, _, length in parts)
    if covered != math.prod(box):
        raise ValueError(f"{what}: the saved chunks cover {covered} of the {math.prod(box)} elements of the block "
                         f"at {offset} of shape {box} (a damaged checkpoint index?)")
    if len(parts) == 1:
        return _read_part(*parts[0], what)
    out = torch.empty(box, dtype=dtype)
    for chunk, start, length in parts:
        narrow_to_box(out, start, length, offset).copy_(_read_part(chunk, start, length, what))
    return out


def _read_part(chunk, start, length, what: str) -> torch.Tensor:
    """The part (start, length) of one saved chunk, in its stored dtype, its checksum checked
    when this part holds the chunk's first element."""
    path, data_offset, stored_dtype, chunk_offset, chunk_shape, crc = chunk
    inside = [s - c for s, c in zip(start, chunk_offset)]
    piece = read_block(path, data_offset, stored_dtype, chunk_shape, inside, length, what)
    if crc == NO_CHECKSUM or any(inside):
        return piece
    if list(length) == list(chunk_shape):
        found = checksum(_bytes_of(piece))
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            found = _file_checksum(fd, data_offset, math.prod(chunk_shape) * piece.element_size(), path, what)
        finally:
            os.close(fd)
    if found != crc:
        raise ChecksumError(f"{what}: checkpoint file {path}: the chunk at offsets {list(chunk_offset)} of shape "
                            f"{list(chunk_shape)} has crc32 {found:#010x}, the index recorded {crc:#010x}: the file "
                            "is damaged, or not the one this save wrote (load with verify=False to read it anyway)")
    return piece
