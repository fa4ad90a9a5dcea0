"""Host buffers a worker keeps between collectives (comm.GlooCommunicator's packing)."""
from __future__ import annotations

import threading

import torch

__all__ = ["ScratchBuffers", "SCRATCH_MAX_BYTES"]


class ScratchBuffers:
    """Host buffers kept between collectives for what never leaves one: the packed pieces an
    all-to-all sends, the pieces a reduce-scatter receives and reduces at once. A fresh buffer
    of several MiB costs more than the copy into it (glibc maps it anew and the first touch
    faults every page in: 1.2 ms against 0.6 ms for 8 MiB here), and the raw collective a
    redistribute is measured against reuses its buffers. One per thread and role, so no two
    uses overlap; grown to the largest use up to SCRATCH_MAX_BYTES, beyond that allocated per use."""

    def __init__(self):
        self._local = threading.local()

    def take(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous tensor of `like`'s shape and dtype, valid until the next
        take of `role` on this thread."""
        nbytes = like.numel() * like.element_size()
        if nbytes > SCRATCH_MAX_BYTES:
            return torch.empty(like.shape, dtype=like.dtype)
        buffers = self._local.__dict__
        buffer = buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(like.dtype).view(like.shape)

    def forget(self) -> None:
        """Take fresh buffers from here on (this thread's old ones stay with whoever holds them)."""
        self._local.__dict__.clear()


SCRATCH_MAX_BYTES = 64 << 20   # a worker keeps at most 2 x this (sent + received) per thread
