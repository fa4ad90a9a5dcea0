"""The exceptions dtorch raises: one small hierarchy, so callers can catch what they mean.

Controller-side checks raise at the user's own line (ShapeError, PlacementError, MeshError).
Worker-side failures come back tagged with the command's sequence number and surface at the
next read of a result that depends on them (RemoteError, DependencyError).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import CodeType, FrameType

__all__ = [
    "DTorchError", "ShapeError", "PlacementError", "MeshError", "UnsupportedOpError", "UnsupportedMethodError",
    "CompileError", "RemoteError", "DependencyError", "WorkerLostError", "LostTensorError", "ProtocolError",
    "StartupError", "SessionEndedError", "UnreadFailureWarning", "user_site", "user_frame", "user_position",
    "format_site", "site_location",
]


class DTorchError(Exception):
    """Base of every error dtorch raises on purpose."""


class ShapeError(DTorchError, ValueError):
    """Shapes that cannot meet: checked on the controller before anything is sent."""


class PlacementError(DTorchError, ValueError):
    """A placement combination an op does not accept; the message names the legal ones."""


class MeshError(DTorchError, ValueError):
    """Tensors on different meshes, or a mesh the running workers cannot form."""


class UnsupportedOpError(DTorchError, NotImplementedError):
    """An op dtorch has no rule for (yet)."""


class UnsupportedMethodError(UnsupportedOpError, AttributeError):
    """A torch.Tensor method or attribute DTensor does not have (yet). Also an AttributeError, so
    hasattr(x, name) and getattr(x, name, default) answer as they would for any missing name."""


class LocalTensorError(DTorchError, TypeError):
    """A torch.Tensor of this process among an op's DTensor arguments, in strict mode (outside it,
    dtorch uploads it Replicate, as a constant)."""


class CompileError(DTorchError, RuntimeError):
    """dtorch.compile cannot capture a function: it reads a value, uploads data, or does something
    a replay could not repeat. The message names the line inside the function."""


class RemoteError(DTorchError):
    """An exception raised inside a worker while running one command."""

    def __init__(self, op: str, seq: int, ranks: list[int], remote_traceback: str,
                 user_site: str, exception_type: str = "", message: str = ""):
        self.op, self.seq, self.ranks = op, seq, sorted(ranks)
        self.remote_traceback, self.user_site = remote_traceback, user_site
        self.exception_type, self.remote_message = exception_type, message
        super().__init__(self._describe())

    def _describe(self) -> str:
        return (f"{self.op} failed on rank(s) {self.ranks} (command #{self.seq}), issued at "
                f"{self.user_site}:\n  {self.exception_type}: {self.remote_message}\n"
                f"--- remote traceback (rank {self.ranks[0]}) ---\n{self.remote_traceback}")


class DependencyError(RemoteError):
    """A result that could not be computed because an earlier command it depends on failed."""

    def _describe(self) -> str:
        return ("this result depends on a command that failed: " + super()._describe())


class WorkerLostError(DTorchError):
    """A worker process died or stopped answering heartbeats."""

    def __init__(self, rank: int, host: str, pid: int | None, reason: str):
        self.rank, self.host, self.pid, self.reason = rank, host, pid, reason
        super().__init__(f"worker rank {rank} on host {host} (pid {pid}) is lost: {reason}. "
                         "Results that live on it cannot be read; dtorch.replace_lost_workers() starts "
                         "a new process for that rank (then rebuild the tensors that lived on it), or "
                         "dtorch.shutdown() and a new mesh start fresh workers.")


class LostTensorError(WorkerLostError):
    """A tensor kept from before dtorch.replace_lost_workers() whose mesh held a rank that was
    lost: its data went with the lost process. A WorkerLostError, so one handler covers both."""

    def __init__(self, rank: int, host: str, pid: int | None, reason: str, message: str):
        self.rank, self.host, self.pid, self.reason = rank, host, pid, reason
        DTorchError.__init__(self, message)


class ProtocolError(DTorchError):
    """A malformed or out-of-order message: the wire cannot be trusted any more."""


class StartupError(DTorchError):
    """Workers could not be started or did not register in time."""


class SessionEndedError(DTorchError):
    """A tensor, read or command of a session that dtorch.shutdown() (or exit) has ended.
    Tensors never carry over to a later session: their data went with its workers."""


class UnreadFailureWarning(RuntimeWarning):
    """At shutdown: a command failed on a worker and no read or synchronize() ever raised it."""


def _package_dir(name: str) -> str:
    """The folder a package imports from, with its trailing separator (so `dtorch` does not
    match a sibling `dtorch_examples`), found without importing the package."""
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec and spec.origin else "\0"


# Frames in these folders are never the user's line: dtorch's own, and torch's, which calls
# back into dtorch through __torch_function__ (torch/overrides.py, torch/nn/functional.py, ...).
LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, _package_dir("torch"))


def user_frame(skip: int = 0) -> tuple[str, int] | None:
    """(file, line) of the first frame outside dtorch and torch: the user's own line that issued
    a call, for an error raised now. `skip`: callers known to be inside dtorch, not worth testing
    one by one."""
    position = user_position(skip + 1)
    return None if position is None else (position[0].co_filename, _line_at(*position))


def user_position(skip: int = 0) -> tuple[CodeType, int] | None:
    """The user's frame (see user_frame) as (code object, offset of the instruction running in
    it): the line number is worked out only when an error names it (format_site). The controller
    records one for every command, and a frame's f_lineno scans its code's line table from the
    start: 1-2 us per op from a loop in a long script or function, where this costs nothing extra."""
    frame: FrameType | None = sys._getframe(1 + skip)
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARY_DIRS):
        frame = frame.f_back
    return None if frame is None else (frame.f_code, frame.f_lasti)


def _line_at(code: CodeType, offset: int) -> int:
    """The line of the instruction at byte `offset` in `code`, as f_lineno gives it."""
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return line
    return code.co_firstlineno


def format_site(site: tuple[str, int] | tuple[CodeType, int] | None) -> str:
    """file:line of a user_frame, or of a user_position."""
    if site is None:
        return "<unknown line>"
    return "%s:%d" % site_location(site)


def site_location(site: tuple[str, int] | tuple[CodeType, int]) -> tuple[str, int]:
    """(file, line) of a user_frame, or of a user_position."""
    where, at = site
    if type(where) is CodeType:
        return where.co_filename, _line_at(where, at)
    return where, at


def user_site() -> str:
    return format_site(user_frame())
