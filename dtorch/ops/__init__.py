"""PURE: op families (one rule table each), their N-D expansion and the call -> plan dispatch.

Importing this package registers every family; nothing here imports zmq or asyncio."""
from . import indexing, matrix, nn, pointwise, reduction, view  # noqa: F401  (each registers its table)
from .dispatch import OpPlan, cached_plan
from .registry import KERNELS, REGISTRY, OpSpec, lookup

__all__ = ["OpPlan", "cached_plan", "KERNELS", "REGISTRY", "OpSpec", "lookup"]
