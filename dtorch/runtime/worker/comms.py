"""A worker's two communicators (runtime/devices/comm.py), held in one place: `comm` for the
collectives of a mesh (NCCL between GPUs, Gloo on CPU) and `host_comm` (Gloo: transfers that
leave the GPUs, agreements on failures, the store; the same object as `comm` on CPU).

One Comms per worker (worker.py makes it), shared by reference with the handler components that
communicate (moves.py, training.py). Each reads `comm` and `host_comm` here when it uses them, so
the recording wrappers dtorch.profile puts in their place for a while (profiling.CommandRecorder)
see every collective, wherever it is issued.
"""
from __future__ import annotations

from ..devices.comm import Communicator

__all__ = ["Comms"]

# What a rank without a failure passes to agree_max in agree_on_failure, which agrees on the
# earliest origin as the largest negated one: below every negated seq.
_NO_FAILURE = -(1 << 62)


class Comms:
    def __init__(self, comm: Communicator, host_comm: Communicator | None = None):
        self.comm = comm
        self.host_comm = host_comm or comm

    def distinct(self) -> list:
        """The communicators, each once (one on CPU, where host_comm is comm)."""
        return [self.comm] if self.host_comm is self.comm else [self.comm, self.host_comm]

    def agree_on_failure(self, ranks: tuple, origin: int) -> int:
        """The earliest failure origin (a command seq) any of `ranks` passed, -1 for none, over
        the host channel. Every rank involved must call it, failed or not. The earliest, as a
        read picks among its ranks' statuses (reads.FetchRead.finish): a later origin may be a
        failure that followed from it, and a read names the first failure of its chain."""
        if len(ranks) == 1:
            return origin
        agreed = self.host_comm.agree_max(ranks, -origin if origin >= 0 else _NO_FAILURE)
        return -agreed if agreed != _NO_FAILURE else -1

    def regroup(self, generation: int, replaced: tuple) -> None:
        """Lost ranks were replaced: no group holding one is used again (Communicator.regroup)."""
        for comm in self.distinct():
            comm.regroup(generation, replaced)
