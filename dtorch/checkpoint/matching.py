"""Which stored tensor loads into which target, checked in full before anything is issued: missing
and unexpected names, shapes, and dtype casts. Every problem found goes into one error, so a
checkpoint never loads halfway.

The cast rule is nn.module.castable, the one Module.load_state_dict applies to torch tensors:
torch.can_cast (numpy's "same_kind"): float -> any float (fp32 -> bf16 rounds), int -> int or
float, bool -> anything. Refused: float -> int and anything -> bool (they would silently
truncate), complex -> real.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..spec.placements import DeviceMesh, Placement, Replicate
from ..nn.module import IncompatibleKeys, castable
from ..ops.tensor_meta import check_placements
from .safetensors_header import CheckpointError, StoredTensor, first_names

__all__ = ["TensorTarget", "IncompatibleKeys", "as_target", "match"]


class TensorTarget(NamedTuple):
    """What one checkpoint tensor becomes: its global shape, dtype and layout in dtorch."""
    shape: tuple
    dtype: torch.dtype
    device_mesh: DeviceMesh
    placements: Sequence[Placement] | None = None   # None: Replicate on every mesh dim


def as_target(name: str, target) -> TensorTarget:
    """A TensorTarget from one (or a plain (shape, dtype, mesh, placements) tuple), placements checked."""
    shape, dtype, mesh, placements = TensorTarget(*target)
    shape = tuple([int(s) for s in shape])
    if not isinstance(dtype, torch.dtype) or not isinstance(mesh, DeviceMesh):
        raise CheckpointError(f"target {name!r}: expected (shape, torch dtype, DeviceMesh, placements), "
                              f"got {target!r}")
    placements = [Replicate()] * mesh.ndim if placements is None else placements
    return TensorTarget(shape, dtype, mesh, check_placements(placements, len(shape), mesh))


def match(stored: dict[str, StoredTensor], targets: dict[str, TensorTarget], strict: bool):
    """([(name, stored tensor, target)] in the targets' order, IncompatibleKeys); CheckpointError
    naming every problem: missing / unexpected names (strict only), shapes, casts."""
    missing = [name for name in targets if name not in stored]
    unexpected = [name for name in stored if name not in targets]
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {first_names(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not expected ({len(unexpected)}): {first_names(unexpected)}")
    pairs = [(name, stored[name], target) for name, target in targets.items() if name in stored]
    problems += [_mismatch(name, entry, target) for name, entry, target in pairs]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError("cannot load this checkpoint; nothing was loaded:\n  " + "\n  ".join(problems[:12])
                              + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""))
    return pairs, IncompatibleKeys(missing, unexpected)


def _mismatch(name: str, entry: StoredTensor, target: TensorTarget) -> str | None:
    if tuple(entry.shape) != target.shape:
        return (f"{name!r}: shape {list(entry.shape)} in the checkpoint ({entry.path}), "
                f"{list(target.shape)} expected")
    if not castable(entry.dtype, target.dtype):
        return (f"{name!r}: dtype {entry.dtype} in the checkpoint cannot become {target.dtype} without "
                "silently losing values (float -> int, anything -> bool); load it as "
                f"{entry.dtype} and convert it yourself")
    return None

