"""DTensor's API in one table. Everything DTensor has beyond the class body of dtensor/tensor.py
(a method, a property, a seam a higher layer fills), and every torch function that
__torch_function__ runs as dtorch's own Python for a DTensor (TORCH_FUNCTIONS), is registered
here, with the line that registered it. This is the one module that assigns onto DTensor
(tests/test_api_table.py reads the source of every other module to hold it to that).

A name is registered once. A second registration is refused with both places named, whatever
the import order: before this table, three mechanisms with different rules (first writer wins,
last writer wins) let the order of dtorch/__init__.py's imports decide a clash silently. A
registration over a name of the class body is refused too, unless it says so
(`over_class_body=True`, for the one replacement the design needs: `data`'s setter, which
dtensor/inplace.py adds to the class body's getter).

Registration installs at once: a module may read what a module imported before it registered
(torch_api/methods.py aliases `clip_` to the in-place `clamp_`). `seal()` runs last (dtorch/__init__.py):
every public torch.Tensor name DTensor still lacks reads as its refusal.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["TORCH_FUNCTIONS", "bind", "register_method", "register_methods", "register_function",
           "register_functions", "register_torch_spellings", "has_method", "in_class_body", "seal", "sites"]

# torch's function name -> dtorch's composition of ops (nn/functional.py's cross_entropy, a mean
# over a sharded batch as a sharded sum over a count; factories.py's zeros_like, a factory).
TORCH_FUNCTIONS: dict[str, Callable] = {}

_tensor_type: type | None = None
_class_body: frozenset = frozenset()
_method_sites: dict[str, str] = {}     # name -> "module.py:line" that registered it
_function_sites: dict[str, str] = {}


def bind(tensor_type: type) -> None:
    """dtensor/tensor.py hands over DTensor right after its class body, which is noted as it is."""
    global _tensor_type, _class_body
    _tensor_type, _class_body = tensor_type, frozenset(tensor_type.__dict__)


def _site(depth: int) -> str:
    """The registering line, outside this module."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    return f"{path.split('/dtorch/', 1)[-1] if '/dtorch/' in path else path}:{frame.f_lineno}"


def register_method(name: str, value, *, over_class_body: bool = False) -> None:
    """Make `value` DTensor's attribute `name` (a function, a property, a descriptor)."""
    site = _site(2)
    if name in _method_sites:
        raise RuntimeError(f"DTensor.{name} is registered twice: at {_method_sites[name]} and at {site}; "
                           f"one name has one definition (dtorch/dtensor/api.py)")
    if name in _class_body and not over_class_body:
        raise RuntimeError(f"DTensor.{name} is defined in DTensor's class body (dtorch/dtensor/tensor.py); "
                           f"{site} registers it again: pass over_class_body=True if replacing it is the design")
    _method_sites[name] = site
    setattr(_tensor_type, name, value)


def register_methods(methods: dict) -> None:
    for name, value in methods.items():
        register_method(name, value)


def register_function(name: str, function: Callable) -> None:
    """What `torch.<name>(x)` (or torch.nn.functional's, or `torch.Tensor.<name>(x)`) runs for a DTensor."""
    site = _site(2)
    if name in _function_sites:
        raise RuntimeError(f"torch function {name!r} is registered twice: at {_function_sites[name]} and at "
                           f"{site}; one name has one definition (dtorch/dtensor/api.py)")
    _function_sites[name] = site
    TORCH_FUNCTIONS[name] = function


def register_functions(functions: dict) -> None:
    for name, function in functions.items():
        register_function(name, function)


def register_torch_spellings(functions: dict) -> None:
    """torch functions composed of ops (torch_api/): each registered as the torch function, and as a
    DTensor method where torch.Tensor has that method and DTensor's class body does not."""
    import torch
    for name, function in functions.items():
        register_function(name, function)
        if hasattr(torch.Tensor, name) and name not in _class_body:
            register_method(name, function)


def in_class_body(name: str) -> bool:
    return name in _class_body


def has_method(name: str) -> bool:
    """Whether DTensor has `name` itself: in its class body or registered (not only torch.Tensor's)."""
    return name in _class_body or name in _method_sites


def sites() -> dict:
    """{"methods": name -> site, "functions": name -> site}: where each registered name came from."""
    return {"methods": dict(_method_sites), "functions": dict(_function_sites)}


def seal(refusal: Callable[[str], object]) -> None:
    """Once every module has registered (dtorch/__init__.py calls this last): each public
    torch.Tensor name DTensor still lacks reads as `refusal(name)`, a descriptor that raises what
    to write instead."""
    import torch
    for name in dir(torch.Tensor):
        if not name.startswith("_") and not has_method(name):
            setattr(_tensor_type, name, refusal(name))
