"""Peak memory and busy time of local processes, read from /proc (Linux only).

Peak memory is VmHWM, the high-water mark of the resident set. It counts every resident page
the process maps, shared ones included (torch's libraries, the worker template's pages), so
`rss_mib` just before the measured work is reported with it as the floor. `reset_peak` sets
the mark back to the current RSS (writing "5" to /proc/<pid>/clear_refs, allowed on one's own
processes), so that a peak covers the measured steps and not the model's construction.

glibc keeps freed heap memory for reuse, so RSS would not fall when a large buffer is freed and
the peak would be a peak of everything ever allocated; `returned_buffers()` sets
MALLOC_MMAP_THRESHOLD_ so that buffers of 128 KiB and more are mmapped and given back on free.
It must be in the environment when a process starts (glibc reads it once), so both sides of a
comparison are started inside it.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

__all__ = ["MMAP_THRESHOLD", "returned_buffers", "peak_mib", "rss_mib", "rss_parts_mib", "reset_peak", "busy_seconds",
           "thread_cpu_seconds", "cpu_seconds", "stat_fields", "minor_faults", "free_tuples",
           "free_tuples_mib"]

MMAP_THRESHOLD = "131072"
_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


@contextlib.contextmanager
def returned_buffers():
    """Processes started inside this block return freed large buffers to the OS."""
    before = os.environ.get(_VARIABLE)
    os.environ[_VARIABLE] = MMAP_THRESHOLD
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_VARIABLE, None)
        else:
            os.environ[_VARIABLE] = before


def _status_mib(pid: int | str, key: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024   # the kernel writes kB
    raise KeyError(f"{key} not in /proc/{pid}/status")


def peak_mib(pid: int | str = "self") -> float:
    return _status_mib(pid, "VmHWM")


def rss_mib(pid: int | str = "self") -> float:
    return _status_mib(pid, "VmRSS")


def rss_parts_mib(pid: int | str = "self") -> tuple[float, float]:
    """(RssAnon, RssFile): the resident pages of the process's own memory (heaps, stacks,
    anonymous maps), and those of mapped files (shared libraries' code and data, faulted in the
    first time a code path runs: bounded by the files' sizes, not a leak)."""
    return _status_mib(pid, "RssAnon"), _status_mib(pid, "RssFile")


def reset_peak(pid: int | str = "self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def busy_seconds(pid: int | str = "self") -> float:
    """Seconds the process's main thread has run or waited for a core to run (/proc/<pid>/schedstat:
    time on a CPU + time runnable on a run queue). The main thread is where a dtorch worker or a torch
    rank computes; it sleeps only when it has nothing to do (waiting for a command, a message, a
    peer). Counting the run-queue wait keeps other load on a shared machine out of the idle time."""
    with open(f"/proc/{pid}/schedstat") as schedstat:
        on_cpu_ns, waiting_ns = schedstat.read().split()[:2]
    return (int(on_cpu_ns) + int(waiting_ns)) / 1e9


def thread_cpu_seconds(pid: int | str, tid: int | str) -> float:
    """Seconds one thread has run on a CPU (/proc/<pid>/task/<tid>/schedstat, in ns: the clock
    ticks of /proc/<pid>/stat are 10 ms, too coarse for a few thousand small ops)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
        return int(schedstat.read().split()[0]) / 1e9


def cpu_seconds(pid: int | str = "self") -> float:
    """Seconds every thread of the process has run on a CPU so far (threads that ended are not
    counted: compare readings of long-lived threads)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += thread_cpu_seconds(pid, tid)
        except OSError:   # the thread ended meanwhile
            continue
    return total


def stat_fields(pid: int | str = "self") -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses): the
    state is [0], minor faults [7], user and system CPU ticks [11] and [12]."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def minor_faults(pid: int | str = "self") -> int:
    """Pages the process has touched for the first time (faults served without I/O)."""
    return int(stat_fields(pid)[7])


_FREE_TUPLES = re.compile(r"(\d+) free (\d+)-sized PyTupleObjects \* (\d+) bytes each")


def free_tuples() -> dict[int, tuple[int, int]]:
    """{size: (count, bytes each)} of the tuples CPython keeps in its free lists in this process
    (sys._debugmallocstats, which writes to fd 2: caught in a temporary file). Memory the
    allocator holds that no object uses, and a full collection empties: where issue 43's creep was
    (docs/design/benchmarks.md, "Soak"). Empty where this Python does not report it."""
    if not hasattr(sys, "_debugmallocstats"):
        return {}
    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return {int(size): (int(count), int(each)) for count, size, each in _FREE_TUPLES.findall(captured.read())}


def free_tuples_mib() -> float:
    return sum(count * each for count, each in free_tuples().values()) / (1 << 20)
