"""dtorch.checkpoint.load: a checkpoint loaded onto the layout of the state it fills, whatever
layout it was saved from. Two formats:

- dtorch's own (save's): the controller reads the index and the files' headers and checks every
  key, shape and cast first; then one LoadChunks per tensor, with which each rank of the target
  layout reads the parts of the saved chunks that overlap its own block
  (runtime/worker/file_shards.py read_region), checking each chunk's crc32 where it reads it.
  Tensor bytes never pass through the controller. With verification on (the default) load waits
  for the workers' reads, so that a chunk whose bytes are not those saved is a CheckpointError at
  the load call, and `state` is left as it was.
- torch.distributed.checkpoint's (dcp_format.py): read in this process, each tensor uploaded onto
  its target's layout.

Before the check, Stateful objects in the state give their state_dict() (stateful.py), and a
dtorch optimizer's state dict gets targets for the state it lacks (optimizer_targets.py); after
the reads, each object's load_state_dict() takes what was loaded.
"""
from __future__ import annotations

import os

import torch

from ..dtensor.factories import tensor as upload
from ..errors import RemoteError
from ..nn.module import SYNC_BYTES
from ..ops.tensor_meta import tensor_meta
from ..runtime.controller import session
from ..dtensor import frontend_state
from ..runtime.worker.file_shards import NO_CHECKSUM
from ..runtime.protocol import LoadChunks, dtype_name
from ..spec.placements import Replicate
from ..dtensor.tensor import DTensor
from .dcp_format import DcpTensor, is_dcp_checkpoint, read_dcp_index, read_dcp_tensor
from .load_checks import check
from .matching import TensorTarget
from .optimizer_targets import optimizer_targets
from .options import Options, resolve
from .safetensors_header import CheckpointError
from .sharded_format import INDEX_NAME, SavedTensor, read_index, read_whole
from .state_tree import fill, flatten, is_distributed
from .stateful import restore, swapped

__all__ = ["load", "read_any_index"]


def load(state, directory, *, strict: bool | None = None, verify: bool = True, options=None):
    """Fill `state` in place from the checkpoint at `directory` and return it: each DTensor leaf
    becomes a new DTensor with the same shape, dtype (the saved values are cast), mesh and
    placements as the one given, whatever layout it was saved from; each plain value becomes the
    saved one; each object with state_dict() / load_state_dict() (a module, an optimizer, an LR
    scheduler) is given the loaded state, and stays in `state`. A dtorch optimizer's state_dict()
    (or the optimizer) needs no state before: its buffers are made from the checkpoint, on their
    parameters' layouts. Every problem (missing / unexpected keys with strict=True, shapes,
    casts, a tensor where a value was saved) is one CheckpointError before anything is issued.
    With strict=False a key the checkpoint lacks keeps its current value.

    `directory` holds a dtorch checkpoint (checkpoint.json) or one torch.distributed.checkpoint
    saved (.metadata). `options`: torch's StateDictOptions (options.py says which fields apply).

    verify=True checks every chunk's crc32 where a worker reads it, and waits for the reads: a
    chunk that is not as saved (a flipped bit, a swapped or replaced file) or that a worker cannot
    read is a CheckpointError here, naming the file, the key and the chunk, and `state` is left
    as it was. verify=False checks nothing and returns at once: a worker that cannot read its
    part raises at the next read. A checkpoint saved without checksums loads unchecked."""
    settings = resolve("load", options, strict=strict)
    index = read_any_index(directory, verify=verify)
    with swapped(state, settings) as slots:
        with optimizer_targets(state, index):
            targets = {key: _as_loaded(leaf.value, settings) for key, leaf in flatten(state, index.style).items()}
            check(index, targets, settings.strict)
            fill(state, _read(index, targets, verify))
        restore(slots, settings)
    return state


def read_any_index(directory, *, verify: bool = True):
    """The checkpoint at `directory`: dtorch's (checkpoint.json) or torch.distributed.checkpoint's."""
    if not os.path.isfile(os.path.join(os.fspath(directory), INDEX_NAME)) and is_dcp_checkpoint(directory):
        return read_dcp_index(directory)
    return read_index(directory, verify=verify)


def _as_loaded(value, settings: Options):
    """What a leaf loads into, under full_state_dict (whole tensors) and cpu_offload (here)."""
    if not settings.full_state_dict or not is_distributed(value):
        return value
    if settings.cpu_offload:   # a placeholder of no memory: read here, in this shape and dtype
        return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    return TensorTarget(tuple(value.shape), value.dtype, value.device_mesh, (Replicate(),) * value.device_mesh.ndim)


def _read(index, targets: dict, verify: bool) -> dict:
    """key -> the loaded value of each target the checkpoint holds."""
    controller = session.controller()
    # plain values first: reading one of torch's format can fail (a class torch.load refuses), and
    # that should stop the load before anything is issued
    loaded = {key: index.values[key] for key in targets if key in index.values}
    seqs, uploaded = [], 0
    for key, target in targets.items():
        saved = index.tensors.get(key)
        if saved is None:
            continue
        if not is_distributed(target):   # a torch tensor here (or a small one in place of a plain value)
            whole = read_dcp_tensor(saved, key) if isinstance(saved, DcpTensor) else read_whole(saved, key,
                                                                                                verify=verify)
            loaded[key] = whole.to(target.dtype) if isinstance(target, torch.Tensor) else whole
        elif isinstance(saved, SavedTensor):
            loaded[key] = _load_chunks(key, saved, target, verify)
            seqs.append(loaded[key]._seq)
        else:   # torch's format: read here, each worker sent its own block
            whole = read_dcp_tensor(saved, key).to(target.dtype)
            loaded[key] = upload(whole, device_mesh=target.device_mesh, placements=list(target.placements))
            uploaded += whole.numel() * whole.element_size()
            frontend_state.count(controller, "checkpoint_bytes_via_controller", whole.numel() * whole.element_size())
            if uploaded >= SYNC_BYTES:   # an upload holds its bytes here until sent
                controller.synchronize()
                uploaded = 0
    frontend_state.count(controller, "checkpoint_tensors_loaded",
                         sum(1 for key, target in targets.items() if key in index.tensors and is_distributed(target)))
    if verify and seqs:
        _wait_for_reads(seqs, index.directory)
    return loaded


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


def _load_chunks(key: str, saved: SavedTensor, target, verify: bool) -> DTensor:
    """One LoadChunks: every rank of the target's mesh (a DTensor's or a TensorTarget's) reads its
    own block of the saved chunks (checking their checksums with `verify`)."""
    controller = session.controller()
    mesh, placements, shape, dtype = target.device_mesh, tuple(target.placements), tuple(target.shape), target.dtype
    chunks = tuple([(chunk.path, chunk.data_offset, dtype_name(chunk.dtype), chunk.offset, chunk.shape,
                    chunk.checksum if verify else NO_CHECKSUM) for chunk in saved.chunks])
    out_id = controller.new_id()
    seq = controller.submit(LoadChunks, out_id, controller.define_mesh(mesh), shape, dtype_name(dtype), placements,
                            chunks, key)
    return DTensor(out_id, tensor_meta(shape, dtype, mesh, placements), seq, controller)

