"""Show workers coming up: a live status line on a terminal, plain lines in logs.

On a TTY one line is redrawn in place:

    workers 3/8 up — node1 3/4 starting, node2 0/4 waiting

Elsewhere (CI logs, files) a line is printed when a host has all its workers up, when a host
fails, and at the end, so a log of a 1000-worker start stays short.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from .failures import explain_ssh_failure
from .hostfile import Host

__all__ = ["StartupProgress", "explain_ssh_failure"]

_CLEAR_LINE = "\r\x1b[K"


@dataclass
class _HostState:
    expected: int
    started: set[int] = field(default_factory=set)
    registered: set[int] = field(default_factory=set)
    failure: str | None = None

    def describe(self, name: str) -> str:
        count = f"{name} {len(self.registered)}/{self.expected}"
        if self.failure is not None:
            return f"{count} failed"
        if len(self.registered) == self.expected:
            return count
        return f"{count} starting" if self.started else f"{count} waiting"


class StartupProgress:
    """Called by the runtime as ``total`` workers on ``hosts`` (filled in hostfile order) start."""

    def __init__(self, total: int, hosts: Sequence[Host], stream: TextIO | None = None):
        self.total = total
        self._stream = stream if stream is not None else sys.stderr
        self._live = _is_terminal(self._stream)
        self._hosts = _expected_per_host(total, hosts)
        self._lock = threading.Lock()
        self._started_at = time.monotonic()

    def worker_started(self, rank: int, host: str) -> None:
        with self._lock:
            self._hosts[host].started.add(rank)
            self._redraw()

    def worker_registered(self, rank: int, host: str) -> None:
        with self._lock:
            state = self._hosts[host]
            state.registered.add(rank)
            if not self._live and len(state.registered) == state.expected:
                self._print(f"{host}: {state.expected}/{state.expected} workers up ({self._elapsed()})")
            self._redraw()

    def host_failed(self, host: str, message: str) -> None:
        with self._lock:
            self._hosts[host].failure = message
            self._print(f"{host}: failed: {message}")
            self._redraw()

    def done(self) -> None:
        with self._lock:
            if self._live:
                self._stream.write(_CLEAR_LINE)
            self._print(f"{self._summary()} ({self._elapsed()})")

    def status_line(self) -> str:
        hosts = ", ".join(state.describe(name) for name, state in self._hosts.items())
        return f"{self._summary()} — {hosts}"

    def _summary(self) -> str:
        up = sum(len(state.registered) for state in self._hosts.values())
        failed = [name for name, state in self._hosts.items() if state.failure is not None]
        summary = f"workers {up}/{self.total} up"
        return f"{summary}; failed: {', '.join(failed)}" if failed else summary

    def _redraw(self) -> None:
        if self._live:
            self._stream.write(_CLEAR_LINE + self.status_line())
            self._stream.flush()

    def _print(self, line: str) -> None:
        # On a terminal the status line is cleared first, and redrawn under the message.
        prefix = _CLEAR_LINE if self._live else ""
        self._stream.write(prefix + line + "\n")
        self._stream.flush()

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self._started_at:.1f}s"


def _expected_per_host(total: int, hosts: Sequence[Host]) -> dict[str, _HostState]:
    # Ranks fill slots in hostfile order, so a run smaller than the hostfile leaves the last hosts idle.
    states, remaining = {}, total
    for host in hosts:
        expected = min(host.slots, remaining)
        remaining -= expected
        if expected:
            # Two hostfile lines may name one machine (different ports): count them together.
            states.setdefault(host.name, _HostState(0)).expected += expected
    if remaining:
        raise ValueError(f"{total} workers do not fit the hosts' {total - remaining} slots")
    return states


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
