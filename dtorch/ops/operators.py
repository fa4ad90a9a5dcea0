"""PURE: Python's operators on a DTensor, each a row (dunder method, op it calls, how docs/reference/ops.md
spells it). dtensor/op_issue.py installs the dunders; ops/tooling/docs.py shows the spellings.

A reflected operator (2 - x reaches x.__rsub__(2)) calls an op whose first operand is the DTensor:
rsub, rdiv, rpow, rfloor_divide and rremainder swap the operands back; add, mul and the bitwise ops commute."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Operator", "BINARY", "UNARY", "BINARY_OPERATORS", "UNARY_OPERATORS", "SPELLINGS"]


class Operator(NamedTuple):
    dunder: str
    op: str
    spelling: str


BINARY = (
    Operator("__add__", "add", "+"), Operator("__sub__", "sub", "-"), Operator("__mul__", "mul", "*"),
    Operator("__truediv__", "div", "/"), Operator("__pow__", "pow", "**"),
    Operator("__floordiv__", "floor_divide", "//"), Operator("__mod__", "remainder", "%"),
    Operator("__radd__", "add", "+"), Operator("__rmul__", "mul", "*"), Operator("__rsub__", "rsub", "scalar - x"),
    Operator("__rtruediv__", "rdiv", "scalar / x"), Operator("__rpow__", "rpow", "scalar ** x"),
    Operator("__rfloordiv__", "rfloor_divide", "scalar // x"), Operator("__rmod__", "rremainder", "scalar % x"),
    Operator("__eq__", "eq", "=="), Operator("__ne__", "ne", "!="), Operator("__lt__", "lt", "<"),
    Operator("__le__", "le", "<="), Operator("__gt__", "gt", ">"), Operator("__ge__", "ge", ">="),
    Operator("__and__", "bitwise_and", "&"), Operator("__or__", "bitwise_or", "|"),
    Operator("__xor__", "bitwise_xor", "^"), Operator("__rand__", "bitwise_and", "&"),
    Operator("__ror__", "bitwise_or", "|"), Operator("__rxor__", "bitwise_xor", "^"),
)
UNARY = (Operator("__neg__", "neg", "unary -"), Operator("__abs__", "abs", "abs()"),
         Operator("__invert__", "bitwise_not", "~"))

BINARY_OPERATORS = {row.dunder: row.op for row in BINARY}
UNARY_OPERATORS = {row.dunder: row.op for row in UNARY}
# op -> its operator spelling (the first row that reaches it)
SPELLINGS = {row.op: row.spelling for row in reversed(BINARY + UNARY)}
