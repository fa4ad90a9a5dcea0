"""PURE: what torch's `x.to(...)` forms ask of a DTensor, and which device a DTensor reports.

A DTensor's device is its mesh's (torch's DTensor reports its local shard's device, the same
thing seen from one rank). So `x.to(x.device)`, `x.to(y.device)` and `x.to("cpu")` on a CPU mesh
are x itself: model code calls them on every forward (GPT-2's `position_embeds.to(
inputs_embeds.device)`, transformers' `labels.to(logits.device)`), and a read there would cut the
gradient and stall the pipeline. A device of another type would be a move between meshes, which
to() does not guess: the refusal says what to write. Reads are only ever explicit (to_torch())."""
from __future__ import annotations

import torch

from ..spec.placements import DeviceMesh
from ..errors import UnsupportedOpError, user_site

__all__ = ["to_target", "mesh_device", "device_refusal"]

# non_blocking: nothing is read, so nothing blocks; memory_format: the workers' layout is theirs
_KEYWORDS = frozenset({"device", "dtype", "non_blocking", "copy", "memory_format"})


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """torch.device("cpu") for a CPU mesh, torch.device("cuda", 0) for a CUDA one."""
    return torch.device("cuda", 0) if mesh.device_type == "cuda" else torch.device(mesh.device_type)


def to_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """(device, dtype, copy) of a to() call: to(dtype), to(device[, dtype]), to(other[, ...]),
    with torch's keywords; None where the call does not say."""
    unknown = set(kwargs) - _KEYWORDS
    if unknown:
        raise TypeError(f"DTensor.to() got unexpected keyword argument(s) {sorted(unknown)}")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for value in args:
        if isinstance(value, torch.dtype):
            dtype = value
        elif isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
            device = value
        elif hasattr(value, "dtype") and hasattr(value, "device"):   # x.to(other): other's dtype and device
            device, dtype = value.device, value.dtype
        else:
            raise _refused_target(value)
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return (None if device is None else torch.device(device)), dtype, bool(kwargs.get("copy", False))


def device_refusal(call: str, device: torch.device, mesh: DeviceMesh) -> Exception:
    """x.to("cuda") on a CPU mesh, x.cpu() on a CUDA mesh: a move to other workers, not made here.
    `call`: the call as the user wrote it, e.g. "x.cpu()"."""
    if device.type == "cpu":
        fix = ("to read the values into this process, x.to_torch(); to keep computing on CPU workers, "
               "move x to a CPU mesh: x.to(cpu_mesh) (x.redistribute(device_mesh=cpu_mesh, placements=[...]))")
    else:
        fix = (f"to compute on {device.type} workers, move x to a mesh of them: x.to({device.type}_mesh) "
               f"(x.redistribute(device_mesh=..., placements=[...])); to read it here, "
               f"x.to_torch().to({str(device)!r})")
    return UnsupportedOpError(f"{call} at {user_site()}: the tensors live on {mesh}, whose workers' device "
                              f"is {mesh.device_type!r}; dtorch does not move tensors between device types "
                              f"implicitly, and never reads them back implicitly. Fix: {fix}.")


def check_new_device(device, mesh: DeviceMesh, call: str, factory: str) -> bool:
    """x.new_ones(..., device=d) and its kin make the new tensor on x's mesh: a `device` of the
    mesh's device type is that (True), None is too (False); another refuses, since the workers
    of that type are another mesh. `call`: as the user wrote it; `factory`: dtorch's own spelling."""
    if device is None:
        return False
    device = torch.device(device)
    if device.type == mesh.device_type:
        return True
    raise UnsupportedOpError(f"{call} at {user_site()}: x lives on {mesh}, whose workers' device is "
                             f"{mesh.device_type!r}, and a tensor made from x lives on x's mesh; dtorch does not "
                             f"move tensors between device types implicitly. Fix: leave device= out, or make it on "
                             f"a mesh of {device.type} workers: {factory}(..., device_mesh={device.type}_mesh, "
                             f"placements=[...]).")


def _refused_target(value) -> Exception:
    if isinstance(value, DeviceMesh):
        return TypeError(f"x.to(...) takes a mesh as its first argument only (at {user_site()}): "
                         "x.to(mesh).to(dtype), or x.redistribute(device_mesh=mesh, placements=[...]).")
    return TypeError(f"DTensor.to() takes a dtype, a device or a tensor, not {value!r}")
