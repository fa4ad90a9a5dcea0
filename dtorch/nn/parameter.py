"""nn.Parameter: a DTensor that a Module registers as one of its parameters."""
from __future__ import annotations

from .. import autograd as _autograd  # noqa: F401  (a Parameter's .grad and backward)
from ..dtensor.tensor import DTensor

__all__ = ["Parameter"]


class Parameter(DTensor):
    """`Parameter(x)` takes the values of DTensor `x` under its own id. The workers' buffer is
    shared, not copied (a `detach` command), so `x` stays usable and each symbol frees only its
    own id. As everywhere in dtorch, values never change under a symbol: rebinding
    `module.weight = Parameter(...)` is how a parameter gets new values."""
    __slots__ = ()

    def __new__(cls, data: DTensor, requires_grad: bool = True):
        # checked before the object exists: a half-built symbol would run DTensor.__del__
        if not isinstance(data, DTensor):
            raise TypeError(f"dtorch.nn.Parameter takes a DTensor, got {type(data).__name__}; upload a "
                            "torch tensor first with dtorch.tensor(t, device_mesh=..., placements=...)")
        return DTensor.__new__(cls)

    def __init__(self, data: DTensor, requires_grad: bool = True):
        alias = data.detach()
        DTensor.__init__(self, alias._id, alias._meta, alias._seq, alias._controller)
        alias._controller = None   # the id is this Parameter's now: only it frees it
        if requires_grad:          # a leaf the workers accumulate gradients into
            self.requires_grad_()

    def __repr__(self) -> str:
        return "Parameter containing:\n" + DTensor.__repr__(self)
