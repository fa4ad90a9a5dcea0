"""A kernel's view of its peers along one mesh dim (a resolved placements.PeerGroup), backed
by the worker's communicator: what ring attention passes its key/value blocks around with, and
what fully_shard's grouped gather (runtime/worker/fsdp_gather.py) gathers and reduce-scatters over."""
from __future__ import annotations

import torch

from ...spec.placements import DeviceMesh, PeerGroup
from ..devices.comm import Communicator

__all__ = ["Peers"]


class Peers:
    def __init__(self, group: PeerGroup, mesh: DeviceMesh, rank: int, comm: Communicator):
        coordinate = mesh.coordinate_of(rank)
        self.ranks = mesh.group_along(rank, group.mesh_dim)
        self.index, self.size = coordinate[group.mesh_dim], len(self.ranks)
        self.blocks = group.blocks(mesh, coordinate)
        self._comm = comm

    def pass_along(self, payload: torch.Tensor, incoming: int) -> torch.Tensor:
        """Send `payload` to the next member of the ring; return the `incoming` elements that
        the previous member sent (every member calls this the same number of times)."""
        received = torch.empty(incoming, dtype=payload.dtype, device=payload.device)
        following = self.ranks[(self.index + 1) % self.size]
        preceding = self.ranks[(self.index - 1) % self.size]
        self._comm.exchange(self.ranks, [(following, payload)], [(preceding, received)])
        return received

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor` (the same shape everywhere), stacked in member order on dim 0."""
        return self._comm.all_gather(self.ranks, tensor)

    def start_all_gather(self, tensor: torch.Tensor):
        """all_gather begun now: (the buffer it fills, what to call before reading it)."""
        return self._comm.start_all_gather(self.ranks, tensor)

    def reduce_scatter(self, stacked: torch.Tensor) -> torch.Tensor:
        """Piece `index` of `stacked` (one piece per member on dim 0), summed over the members."""
        return self._comm.reduce_scatter(self.ranks, stacked, "sum")
