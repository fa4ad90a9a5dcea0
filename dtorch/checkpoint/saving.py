"""dtorch.checkpoint.save: every worker writes its own blocks of the state's DTensors into its own
safetensors file (SaveShard); the controller writes only the index and plain values.

Each chunk's crc32 is computed by the worker that writes it, over the bytes it writes, and
recorded in its file's metadata; after the workers are done the controller copies them from the
files' headers into the index (no reply carries them, no tensor byte reaches the controller).

Atomic: the files go into a fresh sibling directory; the controller waits until every worker has
written and fsynced its files (a Sync, which also raises any worker's error or loss), writes
checkpoint.json last, and only then renames the directory into place. A save that fails or dies
leaves nothing at the target path (an older checkpoint there stays as it was).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import socket
import tempfile

from ..spec.placements import format_placements, local_region
from ..runtime.controller import session
from ..dtensor import frontend_state
from ..runtime.worker.file_shards import recorded_checksums, shard_file_name
from ..runtime.protocol import SaveShard, dtype_name
from ..runtime.transport import process_exists
from ..dtensor.tensor import DTensor
from .safetensors_header import CheckpointError, read_header_and_metadata
from .matching import TensorTarget
from .options import resolve
from .sharded_format import FORMAT, FORMAT_VERSION, INDEX_NAME, check_savable_dtype, encode_value, index_checksum
from .state_tree import flatten
from .stateful import swapped

__all__ = ["save", "FILE_BYTES"]

FILE_BYTES = 1 << 30   # a rank starts a new file (a new SaveShard) past this many bytes in one


def save(state, directory, *, timeout: float | None = None, options=None) -> None:
    """Save `state` (nested dicts and lists of DTensors and plain values, e.g. {"model":
    model.state_dict(), "optim": opt.state_dict(), "step": 7}) to `directory`, replacing a
    checkpoint already there. An object with state_dict() / load_state_dict() (a module, an
    optimizer, an LR scheduler) is saved as what its state_dict() returns. Waits until the
    checkpoint is complete on disk; raises (and leaves no checkpoint at `directory`) if a worker
    fails or is lost meanwhile. Partial DTensors are reduced first, among the workers.
    `options`: torch's StateDictOptions (options.py says which fields apply)."""
    settings = resolve("save", options)
    with swapped(state, settings):
        _save(flatten(state), directory, timeout)


def _save(leaves: dict, directory, timeout) -> None:
    # realpath: a symlinked target keeps its link, and the checkpoint goes where it points
    directory = os.path.realpath(os.fspath(directory))
    for key, leaf in leaves.items():
        if isinstance(leaf.value, TensorTarget):
            raise CheckpointError(f"{key!r}: a TensorTarget describes what a load makes; save needs the DTensor")
    tensors = {key: leaf.value for key, leaf in leaves.items() if isinstance(leaf.value, DTensor)}
    for key, tensor in tensors.items():
        check_savable_dtype(key, tensor.dtype)
    values = {key: {"path": list(leaf.path), "value": encode_value(leaf.value, key)}
              for key, leaf in leaves.items() if key not in tensors}
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    _remove_dead_stagings(directory)
    staging = tempfile.mkdtemp(prefix=_staging_prefix(directory, os.getpid()), dir=parent)
    try:
        os.chmod(staging, 0o755)   # mkdtemp's 0700 would be the checkpoint's own mode after the rename
        entries, nbytes = _write_tensors(tensors, {key: leaves[key].path for key in tensors}, staging, timeout)
        index = {"format": FORMAT, "version": FORMAT_VERSION, "tensors": entries, "values": values}
        _write_index(staging, dict(index, crc32=index_checksum(index)))
        _publish(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    state = frontend_state.of(session.controller())
    state.count("checkpoint_tensors_saved", len(tensors))
    state.count("checkpoint_bytes_saved", nbytes)


def _write_tensors(tensors: dict, paths: dict, staging: str, timeout) -> tuple[dict, int]:
    """Issue the SaveShards and wait for every worker; the index entries and the bytes written."""
    controller = session.controller()
    for tensor in tensors.values():
        controller.check_current(tensor)   # not one whose data went with a lost worker
    readable = {key: tensor.reduce_partials() for key, tensor in tensors.items()}   # kept alive until the Sync
    entries, batches, written = _plan(readable, paths)
    for key, tensor in tensors.items():
        entries[key]["saved_as"] = f"{format_placements(tensor.placements)} on {tensor.device_mesh.shape}"
    seqs = [controller.submit(SaveShard, staging, file_index, tuple(writes))
            for file_index, writes in enumerate(batches) if writes]
    try:
        controller.synchronize(timeout)   # every file written and fsynced; a worker's error or loss raises here
    finally:
        # synchronize raised the earliest failure (the cause, when a tensor came from a failed
        # command); the saves' own failures are part of that one error, not news for a later read
        for seq in seqs:
            if seq in controller.reads.failures:
                controller.reads.failures[seq].reported = True
    _record_checksums(entries, staging)
    return entries, sum(written.values())


def _record_checksums(entries: dict, staging: str) -> None:
    """Each chunk's crc32, as its writer recorded it in its file's metadata, into the index."""
    recorded: dict = {}
    for key, entry in entries.items():
        for chunk in entry["chunks"]:
            if chunk["file"] not in recorded:
                metadata = read_header_and_metadata(os.path.join(staging, chunk["file"]))[1]
                recorded[chunk["file"]] = recorded_checksums(metadata)
            if key not in recorded[chunk["file"]]:
                raise CheckpointError(f"{os.path.join(staging, chunk['file'])} records no crc32 for {key!r} "
                                      "(written by a worker of another dtorch?)")
            chunk["crc32"] = recorded[chunk["file"]][key]


def _plan(tensors: dict, paths: dict) -> tuple[dict, list, dict]:
    """(index entries, batches of (rank, tensor_id, key) writes: one SaveShard each, bytes per
    writing rank). A batch ends where one rank's file would pass FILE_BYTES."""
    entries, batches, written, in_batch = {}, [[]], {}, {}
    for key, tensor in tensors.items():
        chunks = []
        for rank, offset, shape, nbytes in _writers(tensor, written):
            if in_batch.get(rank, 0) and in_batch[rank] + nbytes > FILE_BYTES:
                batches.append([])
                in_batch = {}
            in_batch[rank] = in_batch.get(rank, 0) + nbytes
            batches[-1].append((rank, tensor._id, key))
            chunks.append({"file": shard_file_name(rank, len(batches) - 1), "offsets": offset, "shape": shape})
        entries[key] = {"path": list(paths[key]), "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype),
                        "chunks": chunks}
    return entries, batches, written


def _writers(tensor: DTensor, written: dict):
    """(rank, offset, shape, bytes) of each distinct non-empty block of `tensor`, written by one of
    the ranks holding it: the one with the fewest bytes to write so far (`written`, updated), so
    replicated tensors spread over their replicas instead of all landing on rank 0."""
    mesh, placements, shape = tensor.device_mesh, tensor.placements, tuple(tensor.shape)
    holders: dict[tuple, list[int]] = {}
    for rank in mesh.ranks:
        offset, box = local_region(shape, mesh, placements, mesh.coordinate_of(rank))
        if all(box):
            holders.setdefault((tuple(offset), tuple(box)), []).append(rank)
    for (offset, box), ranks in holders.items():
        nbytes = tensor.dtype.itemsize * math.prod(box)
        writer = min(ranks, key=lambda r: (written.get(r, 0), r))
        written[writer] = written.get(writer, 0) + nbytes
        yield writer, list(offset), list(box), nbytes


def _write_index(staging: str, index: dict) -> None:
    """The index, last, fsynced, and the directory entry of every file made durable with it."""
    path = os.path.join(staging, INDEX_NAME)
    try:
        with open(path, "x") as file:
            json.dump(index, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:   # a full disk: say which file, as the workers' errors do
        raise OSError(error.errno, f"{error.strerror} (writing the checkpoint's index)", path) from None
    _fsync_directory(staging)


def _staging_prefix(directory: str, pid: int) -> str:
    """A save's working directory names its host and process, so the next save to the same
    target can tell one whose process died (killed mid-save) from one still being written."""
    return f".{os.path.basename(directory)}.saving-{socket.gethostname()}-{pid}-"


def _remove_dead_stagings(directory: str) -> None:
    """Remove what saves to `directory` from this host left behind when their process died."""
    parent, host = os.path.dirname(directory), socket.gethostname()
    start = f".{os.path.basename(directory)}.saving-{host}-"
    for name in os.listdir(parent):
        pid = name[len(start):].split("-", 1)[0] if name.startswith(start) else ""
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)



def _publish(staging: str, directory: str) -> None:
    """Put the finished checkpoint at `directory`. An existing one is swapped out atomically where
    the system can (renameat2 RENAME_EXCHANGE), else moved aside first: at no moment does
    `directory` hold a partial checkpoint."""
    if os.path.lexists(directory):
        if not os.path.isdir(directory) or (os.listdir(directory) and
                                            not os.path.isfile(os.path.join(directory, INDEX_NAME))):
            raise FileExistsError(f"{directory} exists and is not a dtorch checkpoint: not replacing it")
        if _exchange(staging, directory):
            shutil.rmtree(staging, ignore_errors=True)   # it holds the previous checkpoint now
        else:
            aside = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.old-", dir=os.path.dirname(directory))
            os.rename(directory, os.path.join(aside, "previous"))
            os.rename(staging, directory)
            shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, directory)
    _fsync_directory(os.path.dirname(directory))


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux renameat2); False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
