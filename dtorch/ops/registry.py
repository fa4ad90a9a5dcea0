"""PURE: the closed, counted vocabulary of ops. Each family module adds its rows with `register`.

An op is a name, the torch function that defines it (the reference and the meta-inference
function), a 1-D placement rule, and optionally a `local` hook that picks a different local
kernel for some placements (mean over a sharded dim runs sum/N locally, for instance).
Workers resolve kernels by name from `KERNELS` only: a name arriving from a socket can never
reach an arbitrary attribute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .rules import Call, Rule

__all__ = ["OpSpec", "register", "lookup", "KERNELS", "REGISTRY", "kernel"]


@dataclass(frozen=True)
class OpSpec:
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


REGISTRY: dict[str, OpSpec] = {}
KERNELS: dict[str, Callable] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in REGISTRY:
        raise ValueError(f"op {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    KERNELS.setdefault(spec.name, spec.torch_fn)
    return spec


def kernel(name: str):
    """Decorator: a local kernel the `local` hook of some op may select by name."""
    def add(fn):
        KERNELS[name] = fn
        return fn
    return add


def lookup(name: str) -> OpSpec:
    spec = REGISTRY.get(name)
    if spec is None:
        from .unsupported import unsupported_op   # it reads REGISTRY: imported here, not at the top
        raise unsupported_op(name, f"dtorch op {name!r}")
    return spec
