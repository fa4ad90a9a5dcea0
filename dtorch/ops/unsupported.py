"""PURE: the refusals for what dtorch does not do yet. Each names the user's line and says what to
write instead, so a missing op or an in-place call is never a bare AttributeError, a wall of op
names, or (worst) a flag silently ignored.

In-place methods exist for dtorch's non-view ops (dtorch/dtensor/inplace.py: x.add_, x[i] = v, ...);
the rest (an in-place form of an op dtorch lacks, or one that changes x's storage such as
x.resize_) is refused here with what to write instead, never silently ignored.
"""
from __future__ import annotations

import difflib
import inspect
from typing import cast

from ..errors import UnsupportedMethodError, UnsupportedOpError, user_site
from .registry import REGISTRY

__all__ = ["unsupported_op", "unsupported_method", "inplace_flag_refused", "refuse_inplace_flag",
           "is_inplace_name", "NOTES", "DEVICE_MOVES"]

# What to write instead of an in-place method whose out-of-place twin is not an op of its own.
INPLACE_ALTERNATIVES = {
    "set_": "x.data = source (x then shares source's values, as torch's set_ shares its storage)",
    "resize_": "x = x.reshape(shape) for the same number of elements, or x = dtorch.zeros(shape, ...) for another",
}


def is_inplace_name(name: str) -> bool:
    """torch's spelling of an in-place op: a trailing underscore (add_), never a dunder."""
    return len(name) > 1 and name.endswith("_") and not name.startswith("_")


def nearest_ops(name: str, count: int = 4) -> list[str]:
    """Supported ops whose names are closest to `name` (cumprod -> prod, cumsum): close spellings,
    then ops that share its first three letters or sit inside it, most similar first."""
    similarity = lambda op: difflib.SequenceMatcher(None, name, op).ratio()  # noqa: E731
    close = difflib.get_close_matches(name, REGISTRY, n=count, cutoff=0.6)
    related = [op for op in REGISTRY if len(op) >= 3 and (op in name or op[:3] == name[:3])]
    return list(dict.fromkeys(close + sorted(related, key=similarity, reverse=True)))[:count]


# Names whose refusal needs a word on what to do instead, beyond the nearest op names.
NOTES = {
    # reached only from torch.nn.functional.unfold: the tensor method x.unfold is an op (ops/view.py)
    "unfold": "it extracts sliding blocks of an image batch (im2col), which dtorch has no op for; "
              "x.unfold(dimension, size, step), torch.Tensor's sliding windows along one dim, is supported",
    "from_local": "each rank's shard lives in its worker, not in this process: upload a whole tensor with "
                  "dtorch.distribute_tensor(t, mesh, placements), or make the shards on the workers with a factory "
                  "(dtorch.randn(..., device_mesh=mesh, placements=...)) so no process holds the whole tensor",
    "to_local": "the controller holds no shards: read the whole tensor with x.to_torch() (or await "
                "x.fetch()); x.local_shape(rank) and x.local_offset(rank) say where each rank's shard sits",
}


# torch.Tensor's moves to a device, reached when DTensor's own method is not (torch.Tensor.cuda(x),
# x.xpu()): never an op's name to suggest ("Nearest supported: cummax" said nothing useful).
DEVICE_MOVES = frozenset({"cuda", "cpu", "xpu", "ipu", "mtia", "pin_memory"})


def device_move_refused(name: str, spelled: str, error: type) -> UnsupportedOpError:
    """x.cuda() and its kin where DTensor's method does not answer: what to write instead."""
    if name == "pin_memory":
        return error(f"{spelled}() at {user_site()}: a DTensor holds no memory in this process to pin (its workers "
                     "hold the values); leave the call out, or pin a torch copy: x.to_torch().pin_memory().")
    if name in ("cuda", "cpu"):   # DTensor has these: only torch.Tensor.cuda(x) gets here
        first = (f"torch.Tensor.{name}(x) at {user_site()}: write x.{name}(), DTensor's own method, which returns x "
                 f"on a mesh of {name} workers.")
    else:
        first = f"{spelled}() at {user_site()}: a DTensor's values live on its mesh's workers."
    return error(f"{first} dtorch moves a DTensor to {name} only onto a mesh of {name} workers: build the mesh there "
                 f"(dtorch.init_device_mesh({name!r}, ...)) and make x on it, or move x to one: "
                 f"x.redistribute(device_mesh={name}_mesh, placements=x.placements). For a torch tensor on "
                 f"{name} in this process, read x first: x.to_torch().{name}().")


def unsupported_op(name: str, spelled: str, error: type = UnsupportedOpError,
                   out_of_place_method: bool = False) -> UnsupportedOpError:
    """A torch function (`spelled`: torch.cumprod) or method (x.cumprod) with no dtorch op yet.
    `out_of_place_method`: x.<name without its _> exists (a method composed of ops, as x.t())."""
    if name in DEVICE_MOVES:
        return device_move_refused(name, spelled, error)
    if name in NOTES:
        return error(f"{spelled} is not supported by dtorch yet (at {user_site()}): {NOTES[name]}.")
    if is_inplace_name(name):
        return _inplace_method(name, spelled, error, out_of_place_method)
    return error(f"{spelled} is not supported by dtorch yet (at {user_site()}).{_nearest_hint(name)} "
                 "docs/reference/ops.md lists every supported op.")


def unsupported_method(name: str, out_of_place_method: bool = False) -> UnsupportedMethodError:
    """A torch.Tensor method or attribute that DTensor lacks; an AttributeError too (hasattr)."""
    return cast(UnsupportedMethodError, unsupported_op(name, f"x.{name}", UnsupportedMethodError, out_of_place_method))


def _nearest_hint(name: str) -> str:
    near = nearest_ops(name)
    return f" Nearest supported: {', '.join(near)}." if near else ""


def _inplace_method(name: str, spelled: str, error: type, out_of_place_method: bool) -> UnsupportedOpError:
    base = name[:-1]
    if name in INPLACE_ALTERNATIVES:
        advice = f"Write {INPLACE_ALTERNATIVES[name]} instead."
    elif base in REGISTRY:   # a view op: its in-place form changes x's shape, not its values
        advice = (f"It changes x's shape or layout in place, which dtorch does not do: write "
                  f"{f'x = x.{base}(...)' if REGISTRY[base].method else f'x = dtorch.{base}(x, ...)'} instead.")
    elif out_of_place_method:   # composed of ops (dtorch/torch_api/methods.py: x.t(), x.swapaxes())
        advice = f"Write x = x.{base}(...) instead: the same values in a new tensor."
    else:
        advice = f"dtorch has no {base} op yet either.{_nearest_hint(base)}"
    return error(f"{spelled} changes a tensor in place, which dtorch does not support for this op "
                 f"(at {user_site()}); docs/reference/inplace.md lists the in-place forms it has. {advice}")


def inplace_flag_refused(name: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"dtorch.{name}(..., inplace=True) at {user_site()}: the registry op takes no in-place flag (the "
        f"input would silently keep its old values). Call torch.nn.functional.{name}(x, inplace=True) or "
        f"dtorch.nn.functional.{name}(x, inplace=True), or write y = dtorch.{name}(x) and use y.")


def refuse_inplace_flag(name: str, torch_fn, args: tuple, kwargs: dict) -> None:
    """Raise when a call asks for inplace=True, by keyword or by position (cold path: plans only)."""
    inplace = kwargs.get("inplace", False)
    if not inplace and "inplace" not in kwargs:
        inplace = _positional(torch_fn, args, "inplace")
    if inplace:
        raise inplace_flag_refused(name)


def _positional(fn, args: tuple, parameter: str):
    try:
        bound = inspect.signature(fn).bind_partial(*args)
    except (TypeError, ValueError):   # builtins without a signature take no positional inplace
        return False
    return bound.arguments.get(parameter, False)
