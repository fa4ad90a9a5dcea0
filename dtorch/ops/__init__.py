"""PURE: op families (one rule table each), their N-D expansion and the call -> plan dispatch.

Importing this package registers every family; nothing here imports zmq or asyncio."""
from . import view, indexing, matrix, nn, pointwise, reduction  # noqa: F401  (each registers its table, in this order)
from . import losses  # noqa: F401  (torch.nn.functional's losses: family "nn")
from . import assignment  # noqa: F401  (x[index] = value as an op: dtorch/dtensor/inplace.py)
from . import vision, vision_norm  # noqa: F401  (family "vision": conv2d, pools, interpolate, norms)
from . import advanced_indexing  # noqa: F401  (x[tensor index], index_put, masked_scatter)
from . import linalg  # noqa: F401  (family "linalg": det, inverse, solve, eigh, qr, svd, ... over batch dims)
from .dispatch import OpPlan, cached_plan, lookup
from .registry import KERNELS, REGISTRY, RegisteredOp

__all__ = ["OpPlan", "cached_plan", "KERNELS", "REGISTRY", "RegisteredOp", "lookup"]
