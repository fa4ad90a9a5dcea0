"""dtorch.checkpoint.load: a checkpoint that save wrote, loaded onto the layout of the state it
fills. The controller reads the index and the files' headers and checks every key, shape and cast
first; then one LoadChunks per tensor, with which each rank of the target layout reads the parts of
the saved chunks that overlap its own block (runtime/worker/file_shards.py read_region), checking each
chunk's crc32 where it reads it. Tensor bytes never pass through the controller.

With verification on (the default) load waits for the workers' reads, so that a chunk whose bytes
are not those saved is a CheckpointError at the load call, and `state` is left as it was.
"""
from __future__ import annotations

from ..errors import RemoteError
from ..nn.module import castable
from ..ops.tensor_meta import tensor_meta
from ..runtime.controller import session
from ..dtensor import frontend_state
from ..runtime.worker.file_shards import NO_CHECKSUM
from ..runtime.protocol import LoadChunks, dtype_name
from ..dtensor.tensor import DTensor
from .safetensors_header import CheckpointError, first_names
from .sharded_format import SavedIndex, SavedTensor, fill, flatten, read_index

__all__ = ["load"]


def load(state, directory, *, strict: bool = True, verify: bool = True):
    """Fill `state` in place from the checkpoint at `directory` and return it: each DTensor leaf
    becomes a new DTensor with the same shape, dtype (the saved values are cast), mesh and
    placements as the one given, whatever layout it was saved from; each plain value becomes the
    saved one. Every problem (missing / unexpected keys with strict=True, shapes, casts, a tensor
    where a value was saved) is one CheckpointError before anything is issued. With strict=False
    a key the checkpoint lacks keeps its current value.

    verify=True checks every chunk's crc32 where a worker reads it, and waits for the reads: a
    chunk that is not as saved (a flipped bit, a swapped or replaced file) or that a worker cannot
    read is a CheckpointError here, naming the file, the key and the chunk, and `state` is left
    as it was. verify=False checks nothing and returns at once: a worker that cannot read its
    part raises at the next read. A checkpoint saved without checksums loads unchecked."""
    index = read_index(directory, verify=verify)
    leaves = flatten(state)
    current = {key: leaf.value for key, leaf in leaves.items()}
    _check(index, current, strict)
    loaded, seqs = {}, []
    for key, value in current.items():
        if key in index.tensors:
            loaded[key] = _load_chunks(key, index.tensors[key], value, verify)
            seqs.append(loaded[key]._seq)
        elif key in index.values:
            loaded[key] = index.values[key]
    frontend_state.count(session.controller(), "checkpoint_tensors_loaded", len(index.tensors.keys() & current.keys()))
    if verify and seqs:
        _wait_for_reads(seqs, index.directory)
    return fill(state, loaded)


def _wait_for_reads(seqs: list, directory: str) -> None:
    """Wait until every worker has read its parts; the LoadChunks that failed as one
    CheckpointError (each a worker's message: the file, the key, the chunk)."""
    controller = session.controller()
    try:
        controller.synchronize()
    except RemoteError as error:
        if error.seq not in seqs:   # an earlier command of the user's failed: synchronize's own error
            raise
        failures = controller.reads.failures
        failed = [failures[seq] for seq in seqs if seq in failures]
        for failure in failed:
            failure.reported = True   # told here, not again at a read or at shutdown
        lines = [f"rank(s) {sorted(f.ranks)}: {f.exception_type}: {f.message}" for f in failed]
        raise CheckpointError(f"cannot load the checkpoint {directory}; nothing was loaded ({len(failed)} "
                              f"tensor(s) failed to read):\n  " + "\n  ".join(lines[:12])
                              + (f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else "")) from error


def _check(index: SavedIndex, current: dict, strict: bool) -> None:
    saved = index.tensors.keys() | index.values.keys()
    missing = [key for key in current if key not in saved]
    unexpected = sorted(saved - current.keys())
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {first_names(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not expected ({len(unexpected)}): {first_names(unexpected)}")
    for key, value in current.items():
        is_tensor = isinstance(value, DTensor)
        if is_tensor and key in index.values or not is_tensor and key in index.tensors:
            saved_kind = "a plain value" if key in index.values else "a tensor"
            problems.append(f"{key!r}: {saved_kind} in the checkpoint, "
                            f"{'a DTensor' if is_tensor else type(value).__name__} expected")
        elif is_tensor and key in index.tensors:
            problems.append(_mismatch(key, index.tensors[key], value, index.directory))
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"cannot load the checkpoint {index.directory}; nothing was loaded:\n  "
                              + "\n  ".join(problems[:12])
                              + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""))


def _mismatch(key: str, saved: SavedTensor, target: DTensor, directory: str) -> str | None:
    if saved.shape != tuple(target.shape):
        return f"{key!r}: shape {list(saved.shape)} in the checkpoint ({directory}), {list(target.shape)} expected"
    if not castable(saved.dtype, target.dtype):
        return (f"{key!r}: dtype {saved.dtype} in the checkpoint cannot become {target.dtype} without silently "
                f"losing values (float -> int, anything -> bool); load it into a {saved.dtype} DTensor and "
                "convert it yourself")
    return None


def _load_chunks(key: str, saved: SavedTensor, target: DTensor, verify: bool) -> DTensor:
    """One LoadChunks: every rank of the target's mesh reads its own block of the saved chunks
    (checking their checksums with `verify`)."""
    controller = session.controller()
    mesh, placements, shape, dtype = target.device_mesh, tuple(target.placements), tuple(target.shape), target.dtype
    chunks = tuple((chunk.path, chunk.data_offset, dtype_name(chunk.dtype), chunk.offset, chunk.shape,
                    chunk.checksum if verify else NO_CHECKSUM) for chunk in saved.chunks)
    out_id = controller.new_id()
    seq = controller.submit(LoadChunks, out_id, controller.define_mesh(mesh), shape, dtype_name(dtype), placements,
                            chunks, key)
    return DTensor(out_id, tensor_meta(shape, dtype, mesh, placements), seq, controller)

