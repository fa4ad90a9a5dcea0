"""PURE: the closed, counted vocabulary of ops. Each family module adds its rows with `register`.

An op is a name, the torch function that defines it (the reference and the meta-inference
function), a 1-D placement rule, and optionally a `local` hook that picks a different local
kernel for some placements (mean over a sharded dim runs sum/N locally, for instance).
Every family writes its table as {name: OpRow}, one row type for all; `register_family` turns
the rows into OpSpecs.
Workers resolve kernels by name from `KERNELS` only: a name arriving from a socket can never
reach an arbitrary attribute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import NamedTuple

from .rules import Call, Rule

__all__ = ["RegisteredOp", "OpRow", "register", "register_family", "KERNELS", "PEER_KERNELS", "REGISTRY", "kernel"]


@dataclass(frozen=True)
class RegisteredOp:
    name: str
    torch_fn: Callable
    rule: Rule
    family: str
    # (call, input placements N-D) -> (kernel name, extra kwargs); None = run torch_fn as is
    local: Callable[[Call, list], tuple[str, dict]] | None = None
    # pointwise ops key their scalar operands by type only, so `x * 0.5` and `x * 2.0` share a plan
    scalars_by_type: bool = False
    num_outputs: int = 1
    method: bool = True               # also a DTensor method (x.sum()), besides dtorch.<name>
    doc: str = field(default="", compare=False)


class OpRow(NamedTuple):
    """One row of a family's table: an RegisteredOp without the name (the table's key) and the family."""
    torch_fn: Callable
    rule: Rule
    local: Callable[[Call, list], tuple[str, dict]] | None = None
    scalars_by_type: bool = False
    method: bool = True
    doc: str = ""


REGISTRY: dict[str, RegisteredOp] = {}
KERNELS: dict[str, Callable] = {}
# Kernels that exchange data with their peers (they take a PeerGroup): every member must run
# them, even one whose input failed (with stand-in zeros), or the others would wait forever.
PEER_KERNELS: set[str] = set()


def register(spec: RegisteredOp) -> RegisteredOp:
    if spec.name in REGISTRY:
        raise ValueError(f"op {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    KERNELS.setdefault(spec.name, spec.torch_fn)
    return spec


def register_family(family: str, table: dict[str, OpRow]) -> None:
    for name, row in table.items():
        register(RegisteredOp(name, row.torch_fn, row.rule, family, row.local, row.scalars_by_type,
                        method=row.method, doc=row.doc))


def kernel(name: str, peers: bool = False):
    """Decorator: a local kernel the `local` hook of some op may select by name. `peers`: it
    exchanges data with the other ranks of a PeerGroup (and takes `standin=True`, below)."""
    def add(fn):
        KERNELS[name] = fn
        if peers:
            PEER_KERNELS.add(name)
        return fn
    return add
