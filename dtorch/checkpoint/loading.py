"""Loading a safetensors checkpoint into DTensors: the controller reads headers only and sends one
LoadShard per tensor; each worker reads its own block from the file (runtime/worker/file_shards.py).
Tensor bytes never pass through the controller, except with via_controller=True, the fallback for
hosts that do not all see the checkpoint's path.
"""
from __future__ import annotations

import os

from ..dtensor.factories import tensor as upload
from ..ops.tensor_meta import tensor_meta
from ..runtime.controller import session
from ..dtensor import frontend_state
from ..runtime.worker.file_shards import read_block
from ..runtime.protocol import LoadShard, dtype_name
from ..nn.module import SYNC_BYTES
from ..nn.progress import ProgressBar
from ..dtensor.tensor import DTensor
from .matching import IncompatibleKeys, TensorTarget, as_target, match
from .safetensors_header import StoredTensor, read_checkpoint

__all__ = ["load_tensors", "load_state_dict", "LoadedTensors", "SYNC_BYTES"]

# SYNC_BYTES (nn.module): with a progress bar, or via the controller, the caller waits for the
# workers after about this many bytes, so the bar shows what is loaded, not what is queued, and an
# upload holds at most this much (plus one tensor) on the controller.


class LoadedTensors(dict):
    """name -> DTensor, plus what did not match (strict=False): `missing_keys`, `unexpected_keys`."""

    def __init__(self, tensors=(), incompatible: IncompatibleKeys | None = None):
        super().__init__(tensors)
        self.missing_keys, self.unexpected_keys = incompatible or IncompatibleKeys([], [])

    @property
    def incompatible_keys(self) -> IncompatibleKeys:
        return IncompatibleKeys(self.missing_keys, self.unexpected_keys)


def load_tensors(path: str | os.PathLike, targets: dict, *, strict: bool = True, progress: bool | None = None,
                 via_controller: bool = False) -> LoadedTensors:
    """Load the tensors `targets` names from a safetensors checkpoint (a .safetensors file, a
    model.safetensors.index.json, or a directory holding either).

    targets: name -> TensorTarget(shape, dtype, device_mesh, placements) (or a plain tuple).
    Each stored tensor is cast to its target's dtype (torch.can_cast decides what is allowed).
    Every check (names with strict=True, shapes, casts) runs before anything is sent: an error
    means nothing was loaded. Returns at once, like any dtorch call; a worker that cannot read
    its part (file missing on its host, truncated) raises RemoteError at the next read.
    progress: a bar on stderr (None: when stderr is a terminal); it waits for the workers as it goes.
    via_controller: read each tensor on the controller and upload it (dtorch.tensor), for a
    cluster whose hosts do not all see `path`; slower, memory bounded by SYNC_BYTES."""
    stored = read_checkpoint(os.fspath(path))
    targets = {name: as_target(name, target) for name, target in targets.items()}
    pairs, incompatible = match(stored, targets, strict)
    controller = session.controller()
    bar = ProgressBar(len(pairs), sum(entry.nbytes for _, entry, _ in pairs), progress)
    loaded = LoadedTensors((), incompatible)
    waiting_tensors = waiting_bytes = 0   # issued since the workers were last waited for
    try:
        for name, entry, target in pairs:
            loaded[name] = _through_controller(entry, target) if via_controller else _load_shard(entry, target)
            frontend_state.count(controller, "checkpoint_tensors_loaded")
            if via_controller:
                frontend_state.count(controller, "checkpoint_bytes_via_controller", entry.nbytes)
            waiting_tensors, waiting_bytes = waiting_tensors + 1, waiting_bytes + entry.nbytes
            if (bar.enabled or via_controller) and waiting_bytes >= SYNC_BYTES:
                controller.synchronize()
                bar.advance(waiting_tensors, waiting_bytes)
                waiting_tensors = waiting_bytes = 0
        if bar.enabled and waiting_tensors:
            controller.synchronize()
        bar.advance(waiting_tensors, waiting_bytes)
    finally:
        bar.close()
    return loaded


def load_state_dict(tensors: dict, path: str | os.PathLike, *, strict: bool = True, progress: bool | None = None,
                    via_controller: bool = False) -> LoadedTensors:
    """New values for a state dict of DTensors (name -> DTensor), each with the same shape, dtype,
    mesh and placements as the current one, read from the checkpoint at `path`. With
    strict=False a name the checkpoint lacks keeps its current tensor (listed in missing_keys)."""
    targets = {name: TensorTarget(tuple(t.shape), t.dtype, t.device_mesh, t.placements) for name, t in tensors.items()}
    loaded = load_tensors(path, targets, strict=strict, progress=progress, via_controller=via_controller)
    return LoadedTensors({name: loaded.get(name, current) for name, current in tensors.items()},
                         loaded.incompatible_keys)


def _load_shard(entry: StoredTensor, target: TensorTarget) -> DTensor:
    """One LoadShard: every rank of the target's mesh reads its own block of `entry`."""
    shape, dtype, mesh, placements = target
    controller = session.controller()
    out_id = controller.new_id()
    seq = controller.submit(LoadShard, out_id, controller.define_mesh(mesh), shape, dtype_name(dtype), placements,
                            entry.path, entry.name, entry.data_offset, dtype_name(entry.dtype))
    return DTensor(out_id, tensor_meta(shape, dtype, mesh, placements), seq, controller)


def _through_controller(entry: StoredTensor, target: TensorTarget) -> DTensor:
    """The fallback: the whole tensor is read here, then each worker is sent its own shard."""
    whole = read_block(entry.path, entry.data_offset, entry.dtype, entry.shape, [0] * len(entry.shape),
                       entry.shape, f"tensor {entry.name!r}, on the controller")
    return upload(whole.to(target.dtype), device_mesh=target.device_mesh, placements=target.placements)
