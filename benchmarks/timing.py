"""Result rows and the statistics the report prints: median and p90 over repetitions.

Every sample is in seconds for ONE unit of work (one op, one read, one step), so rows of the
same benchmark compare directly and the ratio to the reference row is a plain division.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable

__all__ = ["Row", "ratio", "format_seconds", "median", "p90", "repeat", "interleaved", "raising", "stopwatch",
           "guarded", "not_installed", "failed"]


@dataclass
class Row:
    benchmark: str
    case: str                       # what was measured, e.g. "(64, 128)" or "P->R, 1 MiB, 2 workers"
    variant: str                    # who ran it, e.g. "dtorch S(0), 4 workers", "raw Gloo all_reduce"
    per: str                        # the unit of work one sample covers: "op", "read", "step"
    samples: list[float] = field(default_factory=list)
    reference: tuple[str, str] | None = None   # (case, variant) of the row to divide by
    note: str = ""
    status: str = "ok"              # "ok", "not installed", or "error: ..."
    unit: str = "s"                 # what a sample counts: seconds, or "B" (bytes, benchmark 11)

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def p90(self) -> float:
        return p90(self.samples)


def ratio(row: Row, rows: list[Row]) -> float | None:
    """The row's median over its reference row's, from the same run; None without one."""
    if row.reference is None or row.status != "ok":
        return None
    for other in rows:
        if (other.benchmark, other.case, other.variant) == (row.benchmark, *row.reference):
            return row.median / other.median if other.status == "ok" and other.median > 0 else None
    return None


def median(samples: list[float]) -> float:
    return _quantile(samples, 0.5)


def p90(samples: list[float]) -> float:
    return _quantile(samples, 0.9)


def _quantile(samples: list[float], q: float) -> float:
    # Linear interpolation between closest ranks: stable for the handful of samples we take.
    if not samples:
        return math.nan
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def repeat(measure_once: Callable[[], float], reps: int, warmup: int = 1) -> list[float]:
    """Call `measure_once` (which times only the part it cares about) warmup + reps times."""
    for _ in range(warmup):
        measure_once()
    return [measure_once() for _ in range(reps)]


def interleaved(measures: dict, reps: int, warmup: int = 1) -> dict:
    """repeat() for several measurements taken in turn (A B C A B C ...), so that a machine whose
    speed drifts during the run (a shared VM's can halve within a minute) weighs on each alike
    and their ratios keep their meaning. {name: samples}, or {name: the exception} for one that
    raised (it leaves the rotation; the others go on)."""
    results: dict = {name: [] for name in measures}
    for rep in range(warmup + reps):
        for name, measure in measures.items():
            if isinstance(results[name], BaseException):
                continue
            try:
                sample = measure()
            except Exception as error:  # noqa: BLE001 -- becomes that variant's error row
                _print_traceback()
                results[name] = error
                continue
            if rep >= warmup:
                results[name].append(sample)
    return results


def raising(error: BaseException) -> Callable[[], float]:
    """A measurement that raises `error`: the stand-in for one whose set-up failed, so that
    interleaved() reports it as that variant's error row."""
    def measure() -> float:
        raise error
    return measure


def stopwatch() -> Callable[[], float]:
    """Start a timer; calling the result returns the seconds elapsed since."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def not_installed(benchmark: str, case: str, variant: str, per: str, package: str) -> Row:
    return Row(benchmark, case, variant, per, status="not installed", note=f"`{package}` is not importable")


def failed(benchmark: str, case: str, variant: str, per: str, error: BaseException) -> Row:
    message = f"{type(error).__name__}: {error}".splitlines()[0][:200]
    return Row(benchmark, case, variant, per, status=f"error: {message}")


def guarded(make_row: Callable[[], Row], benchmark: str, case: str, variant: str, per: str) -> Row:
    """Run one measurement; a failure becomes an error row so the rest of the suite still runs."""
    try:
        return make_row()
    except Exception as error:  # noqa: BLE001 -- reported in the table and on stderr
        _print_traceback()
        return failed(benchmark, case, variant, per, error)


def _print_traceback() -> None:
    """The exception being handled, on stderr: the table shows only its first line."""
    import sys
    import traceback
    traceback.print_exc(file=sys.stderr)


def format_seconds(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
