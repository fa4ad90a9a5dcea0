"""A worker reads its own block of a tensor stored row-major in a file (a checkpoint shard), and
only the bytes of that block: the controller never touches them.

A block of a row-major tensor is a grid of contiguous runs: the dims after the last one the
block cuts are whole, so each run spans the cut dim's length times their size. Runs far apart
(Shard(0), or Shard(1) of a wide matrix) are read one `preadv` each straight into the result; runs
closer than GAP_LIMIT bytes (Shard(1) of a narrow matrix: many tiny runs) are read as the range
covering them, in CHUNK_BYTES pieces, and the block is copied out of it: there a system call per
run costs more than reading the gap. The crossover, measured from the page cache, is between
768 B and 2 KiB gaps (docs/checkpoint.md has the numbers).
"""
from __future__ import annotations

import itertools
import math
import os

import torch

__all__ = ["read_block", "block_runs", "GAP_LIMIT", "CHUNK_BYTES"]

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
    for outer in itertools.product(*(range(o, o + b) for o, b in zip(offset[:cut - 1], box[:cut - 1]))):
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
