"""The one exception a worker's handlers raise for an input a failed command should have made.

A command that raises does not stop the worker: its outputs become "poisoned" with the command's
seq (LocalShards.poison), and a later command that needs one of them raises Poisoned(origin) instead
of running, so its own outputs are poisoned with the same origin and the controller's read names
the first failure (errors.DependencyError).
"""
from __future__ import annotations

__all__ = ["Poisoned"]


class Poisoned(Exception):
    """An input was produced by a failed command (origin seq attached)."""

    def __init__(self, origin: int):
        super().__init__(origin)
        self.origin = origin
