"""A compiled call's signature (dtorch.compile, compile.py): the key its graphs are cached under,
the same in words (what a new signature changed, for compiled.stats()), the numbers marked as
inputs of the graph (compile(fn, scalars=...)), and the tree of what the call returned.
"""
from __future__ import annotations

import inspect

from .dtensor.autocast import autocast_state
from .dtensor.compile_scalars import traced
from .dtensor.recording import Leaf, is_grad_enabled
from .dtensor.tensor import DTensor
from .errors import CompileError

__all__ = ["Marks", "flatten", "described", "differences", "output_tree", "rebuild"]


class Marks:
    """Which arguments of a compiled function are numbers the graph takes as inputs
    (compile(fn, scalars=...)): parameter names, or True for every int and float argument."""

    def __init__(self, fn, scalars, name: str):
        self.every = scalars is True
        self.positions: dict = {}   # positional index -> parameter name, of the marked ones
        self.labels: dict = {}      # positional index -> parameter name, of all
        self.names: set = set()     # keyword names
        scalars = () if self.every else (scalars,) if isinstance(scalars, str) else tuple(scalars)
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}
        variadic = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        for position, (parameter_name, parameter) in enumerate(parameters.items()):
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                self.labels[position] = parameter_name
                if self.every or parameter_name in scalars:
                    self.positions[position] = parameter_name
        if self.every:
            return
        for wanted in scalars:
            if wanted in parameters or variadic:
                self.names.add(wanted)
            else:
                raise ValueError(f"dtorch.compile({name}, scalars=...): {name} has no parameter {wanted!r} "
                                 f"(its parameters: {', '.join(parameters) or 'none'})")

    def take(self, args: tuple, kwargs: dict) -> tuple:
        """((args, kwargs) as the signature sees them: each marked number by its type only, the
        numbers in order, where each was: ("arg", index) or ("kw", name))."""
        numbers, places = [], []
        picked = list(args)
        for index, value in enumerate(args):
            if type(value) in _NUMBER_TYPES and (self.every or index in self.positions):
                numbers.append(value)
                places.append(("arg", index))
                picked[index] = _NUMBER_TYPES[type(value)]
        given = dict(kwargs)
        for name, value in kwargs.items():
            if type(value) in _NUMBER_TYPES and (self.every or name in self.names):
                numbers.append(value)
                places.append(("kw", name))
                given[name] = _NUMBER_TYPES[type(value)]
        return (tuple(picked), given), tuple(numbers), tuple(places)

    def traced(self, args: tuple, kwargs: dict, places: tuple) -> tuple:
        """(args, kwargs) with each marked number a marker the capture finds in the rows, and
        the markers in order."""
        args, kwargs, markers = list(args), dict(kwargs), []
        for kind, where in places:
            if kind == "arg":
                args[where] = traced(args[where], self.labels.get(where, f"argument {where}"))
                markers.append(args[where])
            else:
                kwargs[where] = traced(kwargs[where], where)
                markers.append(kwargs[where])
        return tuple(args), kwargs, markers


class _Number:
    """A marked number in a signature: its type only."""
    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"<an input {self.kind}>"


_NUMBER_TYPES = {int: _Number("int"), float: _Number("float")}


# --- signatures and outputs ------------------------------------------------------------------------
def flatten(value, tensors: list, key: list, seen: dict) -> None:
    """Append the signature of `value` to `key` and its DTensors to `tensors`, each once (a
    DTensor passed twice keys as the same input: replays bind it once)."""
    if isinstance(value, DTensor):
        if id(value) not in seen:
            seen[id(value)] = len(tensors)
            tensors.append(value)
        key.append(("T", value._meta.key, _grad_state(value), seen[id(value)]))
    elif type(value) in (list, tuple):
        key.append((type(value), len(value)))
        for item in value:
            flatten(item, tensors, key, seen)
    elif type(value) is dict:
        key.append((dict, tuple(value)))
        for item in value.values():
            flatten(item, tensors, key, seen)
    elif hasattr(value, "data_ptr"):
        raise CompileError("dtorch.compile: a torch.Tensor argument: upload it with dtorch.tensor(...) before the "
                           "call and pass the DTensor (its values are not part of a signature)")
    else:
        try:
            hash(value)
        except TypeError:
            raise CompileError(f"dtorch.compile: an argument of type {type(value).__name__} is neither a DTensor "
                               "nor hashable, so it cannot be part of a signature; pass DTensors, numbers, "
                               "strings, or tuples, lists and dicts of them") from None
        key.append((type(value), value))


def _grad_state(tensor: DTensor):
    """False, or what a replay's backward builds on: for a leaf, whether it has a grad yet and
    that grad's kind (shape, dtype, placements; bound on the workers), as a guard would check it."""
    node = tensor._node
    if node is None:
        return False
    if type(node) is not Leaf or node.grad is None:
        return True
    return (node.grad._meta.key, node.bound == node.grad._id)


def described(fn, args: tuple, kwargs: dict) -> list:
    """A signature in words, [(label, text)]: each argument by its parameter's name (a DTensor's
    layout, any other value's repr), grad mode and autocast. Worked out only when a call captures."""
    try:
        labels = list(inspect.signature(fn).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        labels = []
    items = [*zip(labels, args), *kwargs.items()] if len(labels) >= len(args) else [
        *((f"argument {k}", v) for k, v in enumerate(args)), *kwargs.items()]
    described: list = []
    for label, value in items:
        _describe(value, label, described)
    return described + [("grad mode", "on" if is_grad_enabled() else "off"), ("autocast", repr(autocast_state()))]


def _describe(value, label: str, described: list) -> None:
    if isinstance(value, DTensor):
        grad = _grad_state(value)
        described.append((label, f"DTensor {value._meta.describe()}" + ("" if grad is False else ", requires grad")
                          + (", grad kept" if type(grad) is tuple else "")))
    elif type(value) in (list, tuple, dict):
        items = value.items() if type(value) is dict else enumerate(value)
        described.append((label, f"{type(value).__name__} of {len(value)}"))
        for k, item in items:
            _describe(item, f"{label}[{k!r}]", described)
    else:
        described.append((label, repr(value)))


def differences(before: list, now: list) -> list:
    """[(label, before, now)] where two signatures in words differ."""
    old = dict(before)
    found = [(label, old.get(label, "(absent)"), text) for label, text in now if old.get(label) != text]
    gone = {label for label, _ in now}
    return found + [(label, text, "(absent)") for label, text in before if label not in gone]


def output_tree(result, start_id: int, inputs: list, name: str, markers: list = ()):
    """(tree, the DTensors the call made and returned). Tree leaves: ("out", k), ("in", k) for a
    returned argument, ("number", k) for a marked number returned as it is, ("const", value) for
    anything else the call returned."""
    outputs: list = []
    made: dict = {}
    input_index = {id(t): k for k, t in enumerate(inputs)}
    marker_index = {id(m): k for k, m in enumerate(markers)}

    def walk(value):
        if id(value) in marker_index and value is markers[marker_index[id(value)]]:
            return ("number", marker_index[id(value)])
        if isinstance(value, DTensor):
            if id(value) in input_index:
                return ("in", input_index[id(value)])
            if value._id <= start_id:
                return ("const", value)   # made before the call (a parameter): the same one every time
            if id(value) not in made:
                made[id(value)] = len(outputs)
                outputs.append(value)
            return ("out", made[id(value)])
        if type(value) in (list, tuple):
            return (type(value), [walk(v) for v in value])
        if type(value) is dict:
            return (dict, {k: walk(v) for k, v in value.items()})
        if any(isinstance(v, DTensor) for v in getattr(value, "__dict__", {}).values()):
            raise CompileError(f"compiled {name} returned a {type(value).__name__} holding DTensors: return "
                               "tensors alone or in a tuple, list or dict, so each call gets its own")
        return ("const", value)

    return walk(result), outputs


def rebuild(tree, outputs: list, inputs: list, numbers: tuple = ()):
    kind, payload = tree
    if kind == "out":
        return outputs[payload]
    if kind == "in":
        return inputs[payload]
    if kind == "const":
        return payload
    if kind == "number":
        return numbers[payload]
    if kind is dict:
        return {k: rebuild(v, outputs, inputs, numbers) for k, v in payload.items()}
    return kind(rebuild(v, outputs, inputs, numbers) for v in payload)
