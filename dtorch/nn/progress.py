"""A plain-text progress bar on stderr for weight loads (Module.load_state_dict, dtorch.checkpoint):
on a terminal only (or when asked), redrawn at most ten times a second, no dependency."""
from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar"]

WIDTH = 30
REDRAW_S = 0.1


class ProgressBar:
    def __init__(self, total_tensors: int, total_bytes: int, enabled: bool | None = None, stream=None):
        """enabled: None = when `stream` (stderr by default) is a terminal; True / False = always / never."""
        self.stream = stream or sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else bool(enabled)
        self.total_tensors, self.total_bytes = total_tensors, max(total_bytes, 1)
        self.tensors = self.bytes = 0
        self._drawn_at = 0.0

    def advance(self, tensors: int, nbytes: int) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        if self.enabled and time.monotonic() - self._drawn_at >= REDRAW_S:
            self._draw()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        self._drawn_at = time.monotonic()
        filled = WIDTH * self.bytes // self.total_bytes
        self.stream.write(f"\rloading weights [{'#' * filled}{'.' * (WIDTH - filled)}] "
                          f"{self.tensors}/{self.total_tensors} tensors, "
                          f"{_gib(self.bytes)}/{_gib(self.total_bytes)} GiB")
        self.stream.flush()


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f}"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stream
        return False
