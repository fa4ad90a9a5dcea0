"""Which tensors went with a lost, since replaced, worker (dtorch.replace_lost_workers).

Tensor ids only grow, so everything built on a mesh before that mesh's lost rank was replaced
has an id below the mesh's cutoff. The controller keeps the latest cutoff as one int and asks
here only for older ids: the hot path pays one integer compare per input."""
from __future__ import annotations

from ...spec.placements import DeviceMesh
from ...errors import LostTensorError, WorkerLostError, format_site, user_frame

__all__ = ["LostTensors"]


class LostTensors:
    def __init__(self) -> None:
        self._cutoffs: dict[DeviceMesh, tuple[int, WorkerLostError]] = {}

    def record(self, mesh: DeviceMesh, cutoff: int, loss: WorkerLostError) -> None:
        """Tensors of `mesh` with an id below `cutoff` lived on the rank `loss` reports."""
        self._cutoffs[mesh] = (cutoff, loss)

    def check(self, tensor) -> None:
        """Raise LostTensorError, at the user's line, if `tensor`'s data went with a lost worker."""
        found = self._cutoffs.get(tensor._meta.mesh)
        if found is None or tensor._id >= found[0]:
            return
        loss = found[1]
        raise LostTensorError(loss.rank, loss.host, loss.pid, loss.reason, (
            f"at {format_site(user_frame(skip=1))}: {tensor!r} was built before worker rank {loss.rank} "
            f"(host {loss.host}, pid {loss.pid}) of its mesh was lost ({loss.reason}) and replaced by "
            "dtorch.replace_lost_workers(); its data went with the lost process. Rebuild it on the mesh: "
            "reload it from a checkpoint (dtorch.tensor, dtorch.checkpoint) or compute it again"))
