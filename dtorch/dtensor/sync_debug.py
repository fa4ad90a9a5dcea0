"""dtorch.set_sync_debug_mode: torch.cuda.set_sync_debug_mode's idea for a single controller.

A blocking read (to_torch(), item(), tolist(), numpy(), bool(x), float(x), f"{loss:.3f}", ...)
is the one place the user's thread waits on the workers. A model's forward should never make
one; when one hides in library code (a `.to(device)` that used to read, a data-dependent shape),
the step runs correctly but stalls the pipeline of issued ops once per call. "warn" names the
line of each blocking read, "error" refuses it there, so such a stall is found in one run.
`await x.fetch()` never blocks the thread and is never flagged.

An *implicit* read is one that dtorch or torch made on the caller's behalf (torch.nn.init reading
a bound, a composite reading a mask): the line that asked for it did not name a read.
dtorch.stats() counts both kinds ("blocking_reads", "implicit_reads").
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

from ..errors import LIBRARY_DIRS, DTorchError, format_site, user_frame

__all__ = ["set_sync_debug_mode", "get_sync_debug_mode", "note_blocking_read", "read_counts", "BlockingReadError",
           "BlockingReadWarning"]

_MODES = {"default": 0, "warn": 1, "error": 2}
_NAMES = {number: name for name, number in _MODES.items()}


class BlockingReadError(DTorchError, RuntimeError):
    """A blocking read under set_sync_debug_mode("error")."""


class BlockingReadWarning(UserWarning):
    """A blocking read under set_sync_debug_mode("warn")."""


class _State:
    mode = 0
    blocking_reads = 0
    implicit_reads = 0
    lock = threading.Lock()


def set_sync_debug_mode(debug_mode: str | int) -> None:
    """"default" (or 0): reads block silently; "warn" (1): each blocking read warns, naming its
    line; "error" (2): each blocking read raises BlockingReadError there. As torch.cuda's."""
    if isinstance(debug_mode, str) and debug_mode in _MODES:
        _State.mode = _MODES[debug_mode]
    elif isinstance(debug_mode, int) and debug_mode in _NAMES:
        _State.mode = debug_mode
    else:
        raise ValueError(f"set_sync_debug_mode takes 'default', 'warn' or 'error' (or 0, 1, 2), not {debug_mode!r}")


def get_sync_debug_mode() -> int:
    """0, 1 or 2, as torch.cuda.get_sync_debug_mode()."""
    return _State.mode


def read_counts() -> dict:
    return {"blocking_reads": _State.blocking_reads, "implicit_reads": _State.implicit_reads}


def note_blocking_read(what: str, shape: tuple) -> None:
    """Called by every blocking read before it waits (DTensor's read methods)."""
    implicit = _asked_by_a_library()
    with _State.lock:
        _State.blocking_reads += 1
        _State.implicit_reads += implicit
    if _State.mode == 0:
        return
    kind = "an implicit blocking read (made by library code on the caller's behalf)" if implicit else "a blocking read"
    message = (f"{what} of a DTensor of shape {tuple(shape)} at {format_site(user_frame())} is {kind}: the "
               f"controller waits there for the workers. Inside a forward or a step, keep values on the "
               f"workers (x.to(other.device) keeps a DTensor), or read with `await x.fetch()`; "
               f"dtorch.set_sync_debug_mode('default') turns this check off.")
    if _State.mode == 2:
        raise BlockingReadError(message)
    warnings.warn(message, BlockingReadWarning, stacklevel=3)


_READ_METHODS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensor.py")


def _asked_by_a_library() -> bool:
    """True when the nearest frame outside DTensor's read methods is dtorch's or torch's own."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == _READ_METHODS:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(LIBRARY_DIRS)
