"""Which line of the user's program issued each recent command, for errors and warnings that
name it: the controller notes it at submit (one slot of a ring per command), and a
dtorch.compile replay notes the lines inside the compiled function its rows came from.

Each ring slot also keeps its seq, so an error about a command older than the ring says its line
is gone instead of naming another's.
"""
from __future__ import annotations

import collections

from ...errors import format_site, site_location
from .. import protocol as wire

__all__ = ["CommandSites", "SITE_RING"]

# The issuing line of the last SITE_RING commands is kept for error messages.
SITE_RING = 1 << 16
REPLAYS_KEPT = 4096   # dtorch.compile replays whose rows' lines errors can still name


class CommandSites:
    def __init__(self):
        self.ring: list = [None] * SITE_RING   # seq % SITE_RING -> (seq, site, what); Controller.submit writes it
        self.replays: collections.deque = collections.deque(maxlen=REPLAYS_KEPT)   # (seq, span, sites)

    def warning_site(self, seq: int) -> tuple[str, str, int]:
        """(what command `seq` was, the file and line that issued it) for a warning it raised: a
        replayed row's is its line inside the compiled function, as an error's is."""
        kept = self.kept(seq)
        row = self.replayed_row(seq) if kept is None or kept[2] is wire.RunGraph else None
        if row is not None:
            filename, _, line = row[1].rpartition(":")
            if line.isdigit():   # not "<freed>" (then the call's line, below)
                return "a compiled call", filename, int(line)
        if kept is None or kept[1] is None:
            return "a command", "<dtorch worker>", 0
        return (_what(kept), *site_location(kept[1]))

    def kept(self, seq: int) -> tuple | None:
        """(seq, site, what) of a command still in the ring, else None."""
        kept = self.ring[seq % SITE_RING]
        return kept if kept is not None and kept[0] == seq else None

    def note_replay(self, seq: int, span: int, sites: list) -> None:
        """RunGraph `seq` replays commands issued at `sites` (dtorch.compile): an error in row i
        names sites[i], the line inside the compiled function."""
        self.replays.append((seq, span, sites))
        self.forget(seq + 1, span - 1)

    def forget(self, first: int, count: int) -> None:
        """Empty the slots of `count` seqs from `first` that get no entry of their own (the rows
        of a replay; Controller._free_released empties a Free's). Left alone, such a slot keeps
        the entry of a command at least SITE_RING seqs older, which no lookup returns, and the
        ring filled slot by slot towards SITE_RING entries (over 10 MB) in minutes or hours: the
        controller's RSS creep of issue 43. A replay of more than SITE_RING rows empties every
        other slot (a command another thread issues meanwhile may lose its line)."""
        count = min(count, SITE_RING - 1)
        start = first % SITE_RING
        head = min(count, SITE_RING - start)   # up to the ring's end; the rest wraps to its start
        self.ring[start:start + head] = [None] * head
        self.ring[:count - head] = [None] * (count - head)

    def replayed_row(self, seq: int) -> tuple[int, str] | None:
        """(the replay's RunGraph seq, the row's file:line inside the compiled function) of a
        command that a replay ran, else None."""
        for first, span, sites in reversed(self.replays):
            if first <= seq < first + span:
                return first, sites[seq - first]
        return None

    def replayed_site(self, seq: int) -> str | None:
        row = self.replayed_row(seq)
        if row is None:
            return None
        kept = self.kept(row[0])
        call = f", in the compiled call at {format_site(kept[1])}" if kept is not None else ""
        return f"{row[1]} (replayed{call})"

    def site_of(self, seq: int) -> str:
        kept = self.kept(seq)
        replayed = (self.replayed_site(seq) if self.replays and (kept is None or kept[2] is wire.RunGraph)
                    else None)
        if replayed is not None:
            return replayed
        if kept is None:
            return (f"<line not kept: command #{seq} was issued more than {SITE_RING} commands before the "
                    "newest, and only the newest keep their line>")
        return format_site(kept[1])

    def command_site(self, seq: int) -> str | None:
        """file:line that issued command `seq`, if still kept (the newest SITE_RING commands)."""
        kept = self.kept(seq)
        return None if kept is None else format_site(kept[1])

    def describe(self, seq: int) -> str:
        kept = self.kept(seq)
        if kept is None:
            return f"command #{seq}"
        return f"command #{seq} ({_what(kept)}, issued at {format_site(kept[1])})"


def _what(kept: tuple) -> str:
    """What a kept command was: a RunOp's user op (`std`), else the command's name."""
    return kept[2] if type(kept[2]) is str else kept[2].__name__
