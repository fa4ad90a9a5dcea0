"""HostCopy: a tensor on its way to host memory, as every device hands it to the worker's reply
loop. A module of its own because both devices make them: runtime/devices/cuda.py imports it from here,
not from runtime/devices/device.py, which imports runtime/devices/cuda.py to make a CudaDevice."""
from __future__ import annotations

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """A tensor on its way to host memory (or None: a fence); `ready()` says when its bytes may
    be sent."""

    def __init__(self, tensor: torch.Tensor | None, event=None):
        self.tensor, self._event = tensor, event

    def ready(self) -> bool:
        return self._event is None or self._event.query()
