"""Hypervisor steal: the CPU time this virtual machine's vCPUs were ready to run while the host ran
something else (the `steal` column of /proc/stat). On a shared VM it is the main reason absolute
times swing between runs of the same code: a step whose process used 100 ms of CPU can take
300 ms of wall time, and nothing inside the guest shows why. The suite reports the share per
benchmark so that a reader can tell a slow run from a slow change.

The counters are VM-wide and in clock ticks (10 ms at the usual USER_HZ of 100), so a share is
only meaningful over a span of many ticks: a benchmark, a row of steps, not one small op.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_ticks", "Meter", "describe"]

_STAT = Path("/proc/stat")
# "cpu  user nice system idle iowait irq softirq steal guest guest_nice": guest time is already
# inside user and nice, idle and iowait are time nothing wanted to run
_RUNNING, _STEAL = (1, 2, 3, 6, 7), 8


def cpu_ticks() -> tuple[int, int] | None:
    """(ticks the VM wanted a CPU: ran or had it stolen, stolen ticks) since boot, summed over
    CPUs; None where /proc/stat has no steal column (not Linux, or an old kernel)."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
        if fields[0] != "cpu" or len(fields) <= _STEAL:
            return None
        stolen = int(fields[_STEAL])
        return sum(int(fields[i]) for i in _RUNNING) + stolen, stolen
    except (OSError, ValueError):
        return None


class Meter:
    """Started on creation; share() is the fraction of the CPU time the VM wanted since then that
    the host gave to someone else (0.0 on bare metal), or None when it cannot be read or the VM
    wanted too little CPU since."""

    MIN_TICKS = 20   # below this a single tick of rounding is >5%: no share

    def __init__(self) -> None:
        self._start = cpu_ticks()

    def share(self) -> float | None:
        end = cpu_ticks()
        if self._start is None or end is None:
            return None
        wanted, stolen = end[0] - self._start[0], end[1] - self._start[1]
        return stolen / wanted if wanted >= self.MIN_TICKS else None


def describe(share: float | None) -> str:
    """'host steal 12%' (of the CPU time the VM wanted), or why there is no figure."""
    if share is None:
        return "host steal not measured" if os.path.exists(_STAT) else "host steal unknown (no /proc/stat)"
    return f"host steal {share:.0%}"
