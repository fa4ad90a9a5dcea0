"""Hypothesis strategies that damage protocol messages, shared by the fuzz tests.

Budget: DTORCH_FUZZ_EXAMPLES (default: the small seeded run CI does) multiplies nothing; it is
the number of examples each fuzz test runs. CI runs derandomized (the same cases every time);
a longer run on demand: DTORCH_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz_*.py
"""
from __future__ import annotations

import os

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dtorch.runtime import protocol as wire


def fuzz_settings(default_examples: int):
    examples = int(os.environ.get("DTORCH_FUZZ_EXAMPLES", default_examples))
    return settings(max_examples=examples, derandomize="DTORCH_FUZZ_EXAMPLES" not in os.environ,
                    deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# Values a forger would try in any field: wrong types, boundaries, huge, negative, nested.
NASTY_INTS = st.sampled_from([-2**63, -2**31, -1, 0, 1, 2, 7, 2**40, 2**63 - 1, 2**64 - 1])
NASTY = st.recursive(
    st.one_of(st.none(), st.booleans(), NASTY_INTS, st.floats(allow_nan=True), st.text(max_size=8),
              st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=2)),
    max_leaves=6)

# msgpack prefixes that claim a length far beyond what follows: bin32, str32, array32, map32, ext32.
LENGTH_CLAIMS = st.sampled_from([b"\xc6\xff\xff\xff\xf0", b"\xdb\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                                 b"\xdf\x7f\xff\xff\xff", b"\xc9\xff\xff\xff\xf0\x01"])


def replace_in(value: tuple, index: int, new) -> tuple:
    index %= len(value)
    return value[:index] + (new,) + value[index + 1:]


@st.composite
def damaged(draw, frames: list, at: int = 0) -> list:
    """One damage to a valid message (a list of bytes frames, its header at index `at`): the
    property under test is that the receiver either handles the result as the real thing or
    rejects it cleanly."""
    frames = list(frames)
    header = wire.unpack(frames[at])
    kind = draw(st.sampled_from(["truncate", "extend", "random", "frames", "field", "version", "kind",
                                 "claim", "raw", "body"]))
    index = draw(st.integers(0, len(frames) - 1))
    if kind == "truncate":
        frames[index] = frames[index][:draw(st.integers(0, max(0, len(frames[index]) - 1)))]
    elif kind == "extend":
        frames[index] = frames[index] + draw(st.binary(min_size=1, max_size=64))
    elif kind == "random":
        frames[index] = draw(st.binary(max_size=64))
    elif kind == "frames":
        change = draw(st.sampled_from(["drop", "add", "empty", "none"]))
        if change == "drop":
            del frames[index]
        elif change == "add":
            frames.insert(index + 1, draw(st.binary(max_size=16)))
        elif change == "empty":
            frames[index] = b""
        else:
            frames = []
    elif kind == "field":
        position = draw(st.integers(0, len(header) - 1))
        frames[at] = _pack(replace_in(header, position, draw(NASTY)))
    elif kind == "version":
        frames[at] = _pack((header[0] + draw(st.sampled_from([-1, 1])),) + header[1:])
    elif kind == "kind":
        frames[at] = _pack((header[0], draw(st.one_of(NASTY_INTS, st.integers(0, 40)))) + header[2:])
    elif kind == "claim":
        frames[index] = draw(LENGTH_CLAIMS) + draw(st.binary(max_size=16))
    elif kind == "raw":
        frames = draw(st.lists(st.binary(max_size=32), max_size=4))
    elif at == 1 and header[1] == wire.Kind.BATCH:   # "body": one value inside a batch's rows replaced
        frames[2] = _damage_rows(draw, frames[2])
    return frames


def _damage_rows(draw, body: bytes) -> bytes:
    rows = wire.unpack(body)
    row_index = draw(st.integers(0, len(rows) - 1))
    row = rows[row_index]
    row = replace_in(row, draw(st.integers(0, len(row) - 1)), draw(NASTY))
    return _pack(replace_in(rows, row_index, row))


def _pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True, default=wire._default)
