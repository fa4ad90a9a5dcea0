"""The meshes the workers know, on the controller: the id each mesh got with its DefineMesh, the
meshes a lost worker retired, and, after dtorch.replace_lost_workers, which tensors went with
the lost process (lost_tensors.py).

A mesh gets its id once, with the one DefineMesh that introduces it; a loss retires every mesh
that holds the lost rank, so that nothing is sent that would wait on a dead worker; regroup lets
those meshes be defined again, under new ids, once the rank runs in a new process.
"""
from __future__ import annotations

import itertools
import threading
from typing import Protocol
from collections.abc import Callable

from ...errors import WorkerLostError
from ...spec.placements import DeviceMesh
from .. import protocol as wire
from .lost_tensors import LostTensors

__all__ = ["MeshBook"]


class _Pool(Protocol):
    def check_ranks(self, mesh: DeviceMesh) -> None: ...
    def lost_among(self, ranks) -> WorkerLostError | None: ...


class MeshBook:
    def __init__(self, pool: _Pool, submit: Callable[..., int], new_id: Callable[[], int]):
        """submit: Controller.submit (DefineMesh and Regroup go out through it); new_id: the next
        tensor id (a regroup's cutoff)."""
        self._pool, self._submit, self._new_id = pool, submit, new_id
        self._ids: dict[DeviceMesh, int] = {}
        self._numbers = itertools.count()   # ids are never reused, even after a lost mesh is dropped
        self._lock = threading.Lock()
        self.lost: dict[DeviceMesh, WorkerLostError] = {}   # retired by a loss, until regroup
        self.generation = 0   # regroups so far (a compiled graph captured before one is captured again)
        # A tensor with an id below first_valid_id may have lived on a lost rank, which
        # lost_tensors decides: the hot path pays one int compare per input.
        self.first_valid_id = 0
        self.lost_tensors = LostTensors()

    def define(self, mesh: DeviceMesh) -> int:
        """The mesh's id; the first call for a mesh also sends DefineMesh (the only way a mesh
        gets an id), after checking that every rank it names is running."""
        mesh_id = self._ids.get(mesh)
        if mesh_id is not None:
            return mesh_id
        with self._lock:   # another thread may be defining it: the id is published only after
            mesh_id = self._ids.get(mesh)   # DefineMesh is queued, so no command can name an
            if mesh_id is None:             # id the workers do not know yet
                if mesh in self.lost:   # nothing is sent that would wait on a dead worker
                    raise self.lost[mesh]
                self._pool.check_ranks(mesh)
                mesh_id = next(self._numbers)
                self._submit(wire.DefineMesh, mesh_id, mesh.device_type, mesh.shape, mesh.ranks)
                self._ids[mesh] = mesh_id
        return mesh_id

    def announce(self) -> None:
        """Define every mesh again after workers join: one that joined after a mesh was defined
        never saw it, yet a transfer from that mesh to a mesh it belongs to names both. Workers
        that knew the mesh define it again identically."""
        for mesh, mesh_id in list(self._ids.items()):
            self._submit(wire.DefineMesh, mesh_id, mesh.device_type, mesh.shape, mesh.ranks)

    def retire(self, rank: int, error: WorkerLostError) -> None:
        """Worker `rank` is lost: every mesh holding it is refused with `error` from now on."""
        for mesh in [m for m in self._ids if rank in m.ranks]:
            self.lost[mesh] = error
            del self._ids[mesh]

    def check_current(self, tensor) -> None:
        """Refuse a tensor whose data went with a lost, since replaced, worker (LostTensorError)."""
        if tensor._id < self.first_valid_id:
            self.lost_tensors.check(tensor)

    def regroup(self, losses: list) -> None:
        """The lost ranks of `losses` (WorkerLostErrors) run in new, registered processes: every
        worker drops the groups that held them (Regroup), meshes that held them can be defined
        again (new ids), and tensors built on those meshes before now are refused."""
        replaced = tuple(sorted(loss.rank for loss in losses))
        by_rank = {loss.rank: loss for loss in losses}
        with self._lock:
            self.generation += 1
            self._submit(wire.Regroup, self.generation, replaced)
            cutoff = self._new_id()   # every tensor built from here on has a larger id
            for mesh in list(self.lost):
                held = [r for r in mesh.ranks if r in by_rank]
                if held:
                    self.lost_tensors.record(mesh, cutoff, by_rank[held[0]])
                if not self._pool.lost_among(mesh.ranks):
                    del self.lost[mesh]
            self.first_valid_id = cutoff
        self.announce()   # the new processes learn the meshes of the survivors
