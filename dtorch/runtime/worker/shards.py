"""A worker's local state: the tensors this rank holds (its shards), by id, which ids a failed
command should have made, which a communication still in flight makes, and the meshes it knows.

One LocalShards per worker (worker.py makes it), shared by the Worker and every handler component
(moves.py, training.py, files.py, graph_commands.py, checkpoint_regions.py). They hold its dicts
by reference, and the Worker's per-op path reads them without going through it: a dict here is
never replaced, only changed in place (set_aside too).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ...spec.placements import DeviceMesh
from .poisoned import Poisoned

__all__ = ["LocalShards"]


class LocalShards:
    """This rank's tensors by id, their failures and their pending communications, and its meshes.
    `device` (runtime/devices/) orders the compute stream after a communication (`tensor`)."""

    def __init__(self, rank: int, device):
        self.rank, self.device = rank, device
        self.tensors: dict[int, torch.Tensor] = {}
        self.poisoned: dict[int, int] = {}          # tensor id -> seq of the command that failed
        self.in_flight: dict[int, object] = {}      # tensor id -> event of the communication making it
        self.meshes: dict[int, DeviceMesh] = {}

    def member(self, mesh_id: int) -> DeviceMesh | None:
        """The mesh if this rank belongs to it. A mesh defined before this worker joined the
        pool is unknown here, and cannot include it."""
        mesh = self.meshes.get(mesh_id)
        return mesh if mesh is not None and self.rank in mesh.ranks else None

    def tensor(self, tensor_id: int) -> torch.Tensor:
        """A tensor for the compute stream to read: if a communication still in flight makes it,
        the compute stream waits for that first (on the device; this thread goes on). Raises
        Poisoned for one a failed command should have made, KeyError for one not here."""
        tensor = self.held(tensor_id)
        if self.in_flight and tensor_id in self.in_flight:
            self.device.wait(self.in_flight.pop(tensor_id), tensor)
        return tensor

    def held(self, tensor_id: int) -> torch.Tensor:
        """A tensor as stored, for communication, which is ordered after compute by itself."""
        tensor = self.tensors.get(tensor_id)
        if tensor is None:
            if tensor_id in self.poisoned:
                raise Poisoned(self.poisoned[tensor_id])
            raise KeyError(f"tensor #{tensor_id} is not on rank {self.rank} (freed, or never created)")
        return tensor

    def keep(self, tensor_id: int, tensor: torch.Tensor, done) -> None:
        """A communication's result, with `done` (its event; None when it has finished) for
        `tensor` to wait on."""
        self.tensors[tensor_id] = tensor
        if done is not None:
            self.in_flight[tensor_id] = done

    def store(self, out_ids: tuple, result) -> None:
        """A kernel's result under its output ids: a tuple or list item by item, else the one."""
        if isinstance(result, (tuple, list)):
            for tensor_id, value in zip(out_ids, result):
                self.tensors[tensor_id] = value
        else:
            self.tensors[out_ids[0]] = result

    def poison(self, ids, origin: int) -> None:
        """`ids` are what the command `origin` (a seq) failed to make: a read of one names it."""
        for tensor_id in ids:
            self.tensors.pop(tensor_id, None)
            self.in_flight.pop(tensor_id, None)
            self.poisoned[tensor_id] = origin

    def free(self, ids) -> None:
        for tensor_id in ids:
            self.tensors.pop(tensor_id, None)
            self.poisoned.pop(tensor_id, None)
            self.in_flight.pop(tensor_id, None)

    @contextmanager
    def set_aside(self):
        """Inside the block, no tensor and no communication in flight (a checkpoint region's
        recompute fills them with its own); after it, what they held before. In place, since
        every holder of these dicts must see the swap: a copy of each table, as long as it is,
        once per recomputed region."""
        tensors, in_flight = dict(self.tensors), dict(self.in_flight)
        self.tensors.clear()
        self.in_flight.clear()
        try:
            yield
        finally:
            self.tensors.clear()
            self.tensors.update(tensors)
            self.in_flight.clear()
            self.in_flight.update(in_flight)
