"""Which line of the user's program issued each recent command, for errors and warnings that
name it: the controller notes it at submit (one slot of a ring per command), and a
dtorch.compile replay notes the lines inside the compiled function its rows came from.

Each ring slot also keeps its seq, so an error about a command older than the ring says its line
is gone instead of naming another's.

The ring holds no object made per command: seqs and instruction offsets live in arrays, and the
other two columns hold objects that already exist (the code object of the user's function, the
op's name or the command's type). A tuple per slot, as before, kept ~65,000 small objects alive
for a lap of seqs each and then freed them, interleaved with everything else a step allocates:
the allocator's pools fragmented, and the controller's RSS crept up ~0.15 MB/min with live data
flat (issue 43's soak; benchmarks/soak_rss.py). The replays are a ring of the same kind.
"""
from __future__ import annotations

from array import array

from ...errors import format_site, site_location
from .. import protocol as wire

__all__ = ["CommandSites", "SITE_RING"]

# The issuing line of the last SITE_RING commands is kept for error messages.
SITE_RING = 1 << 16
REPLAYS_KEPT = 4096   # dtorch.compile replays whose rows' lines errors can still name


_NO_SEQ = -1


class CommandSites:
    """Four columns indexed by seq % SITE_RING, which Controller.submit writes directly (every
    command): `seqs` (the seq the slot holds, or -1), `codes` and `offsets` (the user's
    position, errors.user_position: code object and instruction offset; None for none) and
    `whats` (a RunOp's op name, else the command's type)."""

    def __init__(self):
        self.seqs = array("q", [_NO_SEQ]) * SITE_RING
        self.codes: list = [None] * SITE_RING
        self.offsets = array("q", [0]) * SITE_RING
        self.whats: list = [None] * SITE_RING
        # the newest REPLAYS_KEPT replays: RunGraph seq, its span, and the compiled graph's sites
        # (one list per graph, shared by all its replays), in a ring at replay_count % REPLAYS_KEPT
        self.replay_seqs = array("q", [_NO_SEQ]) * REPLAYS_KEPT
        self.replay_spans = array("q", [0]) * REPLAYS_KEPT
        self.replay_sites: list = [None] * REPLAYS_KEPT
        self.replay_count = 0

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
        slot = seq % SITE_RING
        if self.seqs[slot] != seq:
            return None
        code = self.codes[slot]
        return seq, (None if code is None else (code, self.offsets[slot])), self.whats[slot]

    def note_replay(self, seq: int, span: int, sites: list) -> None:
        """RunGraph `seq` replays commands issued at `sites` (dtorch.compile): an error in row i
        names sites[i], the line inside the compiled function."""
        slot = self.replay_count % REPLAYS_KEPT
        self.replay_seqs[slot], self.replay_spans[slot], self.replay_sites[slot] = seq, span, sites
        self.replay_count += 1
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
        self.seqs[start:start + head] = array("q", [_NO_SEQ]) * head
        self.seqs[:count - head] = array("q", [_NO_SEQ]) * (count - head)
        self.codes[start:start + head] = self.whats[start:start + head] = [None] * head
        self.codes[:count - head] = self.whats[:count - head] = [None] * (count - head)

    def replayed_row(self, seq: int) -> tuple[int, str] | None:
        """(the replay's RunGraph seq, the row's file:line inside the compiled function) of a
        command that a replay ran, else None."""
        newest = self.replay_count - 1
        for back in range(min(self.replay_count, REPLAYS_KEPT)):   # newest first
            slot = (newest - back) % REPLAYS_KEPT
            first = self.replay_seqs[slot]
            if first <= seq < first + self.replay_spans[slot]:
                return first, self.replay_sites[slot][seq - first]
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
        replayed = (self.replayed_site(seq) if self.replay_count and (kept is None or kept[2] is wire.RunGraph)
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
