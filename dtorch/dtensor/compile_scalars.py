"""The numbers a compiled function takes as inputs of its graph (`dtorch.compile(fn, scalars=...)`):
where each landed in the captured commands, so that a replay puts the call's own value there.

While the capture runs, a marked argument is a `TracedFloat` / `TracedInt`: equal to the number,
and found again by identity in the rows the call issued. It is an input of the graph where every
use is a top-level operand of an op whose plan keys scalars by type (the pointwise ops:
`x * scale`, `x + bias`, `scale - x`; ops/registry.py `scalars_by_type`): there its value changes
nothing but the number the workers compute with. Anything else makes the graph keep the value it
saw (a replay holds while the argument equals it, like an unmarked one), and says why:
- Python used the value (arithmetic, a comparison, `int()`, `round()`, an `if`): what it computed
  is a constant of the capture;
- an op whose plan depends on the value took it (`clamp(x, max=m)`, a keyword, a dim, a size);
- it reached no op at all.
Python's C functions read a float without asking it (`math.exp(scale)`, `torch.tensor(scale)`), so
those uses go unseen: pass such a value as a marked argument of its own.
"""
from __future__ import annotations

from sys import _getframe

from ..errors import user_site
from ..ops import REGISTRY
from ..runtime import protocol as wire

__all__ = ["TracedFloat", "TracedInt", "traced", "TRACED", "find_slots"]


class _Traced:
    """What both markers share: the argument's name, and where Python first used the value. The
    wire's reading is not a use: msgpack's packer compares an int with 0 to pick its encoding
    (`o > 0`) when a batch of the rows the capture has issued so far is flushed (a batch that
    waited, in the capture's thread; the workers going idle, in the controller's), and that call
    comes from one of wire.PACKING_CODE."""
    name: str
    used_at: str | None

    def _used(self, result):
        if result is not NotImplemented and self.used_at is None \
                and _getframe(2).f_code not in wire.PACKING_CODE:   # 0: here, 1: the watched method, 2: its caller
            self.used_at = user_site()
        return result


def _watching(base: type, name: str):
    method = getattr(base, name)

    def watched(self, *args):
        return self._used(method(self, *args))
    watched.__name__ = name
    return watched


_FLOAT_USES = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
               "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__",
               "__rpow__", "__neg__", "__pos__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
               "__bool__", "__int__", "__float__", "__round__", "__trunc__", "__floor__", "__ceil__")
_INT_USES = _FLOAT_USES + ("__index__", "__invert__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
                           "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__")


class TracedFloat(_Traced, float):
    def __new__(cls, value: float, name: str):
        made = float.__new__(cls, value)
        made.name, made.used_at = name, None
        return made

    __hash__ = float.__hash__
    __repr__ = float.__repr__


class TracedInt(_Traced, int):
    def __new__(cls, value: int, name: str):
        made = int.__new__(cls, value)
        made.name, made.used_at = name, None
        return made

    __hash__ = int.__hash__
    __repr__ = int.__repr__


for _name in _FLOAT_USES:
    setattr(TracedFloat, _name, _watching(float, _name))
for _name in _INT_USES:
    setattr(TracedInt, _name, _watching(int, _name))

TRACED = (TracedFloat, TracedInt)


def traced(value, name: str):
    """The marker a capture passes instead of `value` (an int or a float, never a bool)."""
    return TracedFloat(value, name) if type(value) is float else TracedInt(value, name)


def find_slots(rows: list, markers: list) -> tuple[tuple, dict]:
    """(slots, kept): slots are (row index, argument index, marker index), one for each
    top-level operand of a scalars-by-type op that is one of `markers`; kept maps a marker's index
    to why the graph keeps its value instead (its slots are dropped then)."""
    index = {id(m): k for k, m in enumerate(markers)}
    slots, kept = [], {}

    def which(value) -> int | None:
        k = index.get(id(value))
        return k if k is not None and value is markers[k] else None
    for row, command in enumerate(rows):
        found = [k for k in map(which, _all_values(command)) if k is not None]
        if not found:
            continue
        by_type = type(command) is wire.RunOp and getattr(REGISTRY.get(command.op), "scalars_by_type", False)
        operands = [(position, which(a)) for position, a in enumerate(command.args if by_type else ())]
        operands = [(position, k) for position, k in operands if k is not None]
        slots += [(row, position, k) for position, k in operands]
        for k in set(found):
            if found.count(k) > sum(1 for _, m in operands if m == k):
                what = command.op if type(command) is wire.RunOp else type(command).__name__
                kept.setdefault(k, f"{what} takes it where its plan depends on the value")
    for k, marker in enumerate(markers):
        if marker.used_at is not None:
            kept[k] = f"Python used its value at {marker.used_at}"
        elif k not in kept and not any(slot[2] == k for slot in slots):
            kept[k] = "no op takes it as it is"
    return tuple([slot for slot in slots if slot[2] not in kept]), kept


def _all_values(value):
    """Every leaf value inside a command's fields (tuples, lists, dicts), depth first."""
    if type(value) is dict:
        for item in value.values():
            yield from _all_values(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _all_values(item)
    else:
        yield value
