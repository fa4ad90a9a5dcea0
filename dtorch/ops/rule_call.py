"""PURE: what a placement rule is given and what it answers (ops/rules.py has the rest of the
vocabulary, and the expansion to N-D meshes). A module of its own because both rules.py and
suggest.py, which words the rules' refusals, need these types: neither imports the other's
module for them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["TensorSlot", "Call", "Decision", "RuleRejected", "Rule"]


class TensorSlot(NamedTuple):
    """Stands in for the k-th tensor argument inside Call.args / Call.kwargs."""
    index: int   # type: ignore[assignment]  # a field named like tuple.index, which it hides on purpose


class Call(NamedTuple):
    op: str
    inputs: tuple          # TensorMeta per tensor argument, in order of appearance
    args: tuple            # positional args, tensors replaced by TensorSlot
    kwargs: dict
    outputs: tuple         # ((shape, dtype), ...) from meta inference

    def param(self, position: int, name: str, default=None):
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[position] if position < len(self.args) else default

    @property
    def out_shape(self) -> tuple:
        return self.outputs[0][0]

    @property
    def mesh(self):
        return self.inputs[0].mesh


class Decision(NamedTuple):
    inputs: tuple          # required placement per input on this mesh dim
    outputs: tuple         # placement per output on this mesh dim


class RuleRejected(Exception):
    def __init__(self, reason: str, legal: str):
        super().__init__(reason)
        self.reason, self.legal = reason, legal


Rule = Callable[[Call, tuple], Decision]
