"""PURE: what torch's `x.to(...)` forms ask of a DTensor. A dtype is a cast (an op); "cpu" is a
read into this process; another device is a move that `to` does not make yet (a mesh first,
x.to(mesh), is a move DTensor.to makes before it asks here)."""
from __future__ import annotations

import torch

from ..distributed_spec import DeviceMesh
from ..errors import UnsupportedOpError, user_site

__all__ = ["to_target"]

# non_blocking: a read to "cpu" blocks whatever it says; copy: every dtorch result is new anyway
_KEYWORDS = frozenset({"device", "dtype", "non_blocking", "copy"})


def to_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None]:
    """(device, dtype) of a to() call; device is None for a plain cast, else torch.device("cpu")."""
    unknown = set(kwargs) - _KEYWORDS
    if unknown:
        raise TypeError(f"DTensor.to() got unexpected keyword argument(s) {sorted(unknown)}")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for value in args:
        if isinstance(value, torch.dtype):
            dtype = value
        elif isinstance(value, (str, torch.device)):
            device = value
        else:
            raise _refused_target(value)
    if device is None:
        return None, dtype
    if torch.device(device).type != "cpu":
        raise UnsupportedOpError(
            f"x.to({str(device)!r}) would move the workers' shards to another device, which to() does "
            f"not do yet (at {user_site()}). To compute there, move x to a mesh of that device with "
            f"x.redistribute(device_mesh=mesh, placements=[...]); to read it here, x.to_torch().to({str(device)!r}).")
    return torch.device("cpu"), dtype


def _refused_target(value) -> Exception:
    if isinstance(value, DeviceMesh):
        return TypeError(f"x.to(...) takes a mesh as its first argument only (at {user_site()}): "
                         "x.to(mesh).to(dtype), or x.redistribute(device_mesh=mesh, placements=[...]).")
    if hasattr(value, "_meta"):
        return UnsupportedOpError(f"x.to(other) is not supported yet (at {user_site()}): use "
                                  "x.to(other.dtype) for its dtype, x.redistribute_like(other) for its layout.")
    return TypeError(f"DTensor.to() takes a dtype or a device, not {value!r}")
