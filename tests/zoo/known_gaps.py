"""The zoo's known gaps, in one table: (model, layout, check) -> (the exception raised today, why).

Each entry is marked xfail(strict=True, raises=<that exception>): CI stays green while the gap is
there; the fix turns the entry into a failure (XPASS), so that it is removed with the fix; and any
other failure (another exception, or a value off torch's: an AssertionError) still fails. Every
reason names the defect of issue 42 it belongs to and the exact error. Checks: "forward",
"train", "no_read" (test_zoo.py says what each compares)."""
from __future__ import annotations

# Empty: every model and layout of the zoo passes every check.
KNOWN_GAPS: dict = {}
