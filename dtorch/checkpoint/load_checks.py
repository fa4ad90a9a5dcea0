"""What dtorch.checkpoint.load checks before it issues anything: every key of the state against the
checkpoint's, every tensor's shape and cast. All the problems found are one CheckpointError, and
each names the key that is really at fault: a key the state holds as one plain value where the
checkpoint holds entries below it (an optimizer's state_dict() that cannot make its state) is
reported as that, with what to pass instead, not as one key missing and dozens unexpected.
"""
from __future__ import annotations

import bisect
import math

import torch

from ..nn.module import castable
from .safetensors_header import CheckpointError, first_names
from .sharded_format import PLAIN_TENSOR_ELEMENTS
from .state_tree import is_distributed

__all__ = ["check"]



def _optimizer_advice(key: str) -> str:
    return (f"load into the optimizer itself ({{{key!r}: opt}}) or into a dtorch.optim optimizer's opt.state_dict(), "
            "whose missing state the load makes from the checkpoint (a copy of a state_dict, or a torch.optim "
            "optimizer's, cannot: it does not know its parameters' layouts)")


def check(index, targets: dict, strict: bool) -> None:
    """CheckpointError listing every problem of loading `index` (a read checkpoint) into `targets`
    (key -> DTensor, TensorTarget, torch tensor or plain value)."""
    saved = sorted(index.tensors.keys() | index.values.keys())
    absent = [key for key in targets if key not in index.tensors and key not in index.values]
    below = {key: under for key in absent if (under := _under(saved, key))}
    missing = [key for key in absent if key not in below]
    unexpected = sorted(set(saved) - targets.keys() - {k for under in below.values() for k in under})
    problems = []
    if strict:
        problems += [_held_below(key, under, targets[key]) for key, under in below.items()]
        if missing:
            problems.append(f"missing from the checkpoint ({len(missing)}): {first_names(missing)}"
                            + _held_whole(missing, index))
        if unexpected:
            problems.append(f"in the checkpoint but not expected ({len(unexpected)}): {first_names(unexpected)}"
                            + _optimizer_hint(unexpected))
    problems += [_mismatch(key, target, index) for key, target in targets.items() if key not in absent]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"cannot load the checkpoint {index.directory}; nothing was loaded:\n  "
                              + "\n  ".join(problems[:12])
                              + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""))


def _under(saved: list, key: str) -> list:
    """The saved keys below `key` ("key.x", "key.x.y"), from the sorted list."""
    start = bisect.bisect_left(saved, key + ".")
    end = bisect.bisect_left(saved, key + "/")   # "/" follows "." in code point order
    return saved[start:end]


def _held_below(key: str, under: list, target) -> str:
    optimizer = _looks_like_optimizer(key, under)
    what = f"one {type(target).__name__} here" + (" (an optimizer's state_dict before its first step?)"
                                                   if optimizer else "")
    advice = (_optimizer_advice(key) if optimizer else
              "pass the object itself if it has state_dict() / load_state_dict(), or a state naming those entries")
    return (f"{key!r} is {what}, but the checkpoint holds {len(under)} entries under it ({first_names(under)}): "
            f"{advice}")


def _looks_like_optimizer(key: str, under: list) -> bool:
    return any(k.startswith(f"{key}.state.") for k in under) and any(k.startswith(f"{key}.param_groups") for k in under)


def _held_whole(missing: list, index) -> str:
    """Where the checkpoint holds a missing key's ancestor as one plain value, say so."""
    for key in missing:
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:cut]) in index.values:
                return (f"; the checkpoint holds {'.'.join(parts[:cut])!r} whole, as one plain value (saved without "
                        "a DTensor below it)")
    return ""


def _optimizer_hint(unexpected: list) -> str:
    owners = sorted({k.split(".state.")[0] for k in unexpected if ".state." in k or k.startswith("state.")})
    if not owners:
        return ""
    return f"; those under '{owners[0]}.state' are an optimizer's buffers: " + _optimizer_advice(owners[0])


def _mismatch(key: str, target, index) -> str | None:
    if key in index.values:
        return f"{key!r}: a plain value in the checkpoint, a DTensor expected" if is_distributed(target) else None
    saved = index.tensors[key]
    if not is_distributed(target) and not isinstance(target, torch.Tensor):
        if math.prod(saved.shape) <= PLAIN_TENSOR_ELEMENTS:
            return None   # a small tensor comes back as a plain torch tensor, as save stores small ones
        return (f"{key!r}: a tensor of shape {list(saved.shape)} in the checkpoint, {type(target).__name__} "
                "expected; load it into a DTensor (or a torch tensor, read in this process)")
    if saved.shape != tuple(target.shape):
        return (f"{key!r}: shape {list(saved.shape)} in the checkpoint ({index.directory}), {list(target.shape)} "
                "expected")
    if not castable(saved.dtype, target.dtype):
        return (f"{key!r}: dtype {saved.dtype} in the checkpoint cannot become {target.dtype} without silently "
                f"losing values (float -> int, anything -> bool); load it into a {saved.dtype} DTensor and "
                "convert it yourself")
    return None
