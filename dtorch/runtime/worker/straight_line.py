"""A compiled graph's runs of plain ops as generated Python functions: each row a line that calls
its kernel on local variables, so a replay pays for the ops and little else.

A replay through the worker's per-command path builds each row's command, finds its inputs in the
id table, runs the kernel and stores the result back in the table: about 3 us of Python per row,
as much as a small op itself. Here a row is one line, `t12 = k_mul_4(t11, 1.0001)`, its tensors
local variables and a Free row a `del`; the ids a run reads before making them are loaded from the
table first, and the ids still alive at its end are stored back (at the graph's end, except
scratch, which the replay drops). The table then holds exactly what running the rows one by one
leaves in it.

A row recorded for backward (`grad`, every op of a training step's forward) is a line too:
`t12 = _recorded(k_mul_4, (t11,), t11, 1.0001)` runs the kernel as the per-command path does
(backward.run_recorded: recorded against its inputs that require grad, saved through fsdp's
hooks where one is a gathered parameter, outputs joined to those inputs). Grad mode is on from
the first such row of a stretch to the next row that is not one, where the mode the run started
in (the worker's: off) comes back. The run's pure form (for fusion.py) calls the kernel itself
instead, with grad mode switched the same way.

A graph's plan (`build`) is its rows in order, each run of plain rows (`plain_row`: tensors,
scalars, dtypes and containers of them in, this rank's block where a rule asks for it, no peers,
no slicing, nothing random, on a mesh that holds this rank) as one function, and every
other row (a collective, a random or optimizer row) as itself, for the worker's per-command path.
A run takes its function only when no communication is in flight and the profiler is off; else
its rows go one by one.

Two kinds of row that are not ops do not end a run, so that a training step's loss (a
cross-entropy between factories and frees) fuses with the forward that made its logits:
- a Factory that draws nothing (zeros, full, arange, ...; never a random row) is hoisted: it goes
  alone just before the run's function, whose rows read it from the table. Nothing in the run
  can read it earlier: its id is new (a factory that rebinds an id the run has used ends the run);
- a Free of ids the table held before the run (ones the run loaded, or never touched) is `del`
  for what the run holds and, in the replay form, a drop from the table; it goes alone again
  just after the function (the pure form has no table; the per-command Free also clears poison
  and in-flight marks). The run loaded those tensors before its first row, and no later row of
  it may read them (one that does ends the run). A Free is idempotent, so the second time, and
  the third where the rows go one by one, frees nothing more.

A row that raises stops the function. Its line names the row, and the function's frame (kept by
the traceback) holds what the rows before it made: those go into the table, the failing row
poisons its outputs and is reported under its own seq, and the rows after it run on the per-command
path, which spreads the poison as in eager. A missing input (freed, or poisoned) raises before
any row of the run starts, and the run goes row by row, which words that error."""
from __future__ import annotations

import keyword
import linecache
import math
import re

import torch

from ...spec.placements import ShardRegion
from .. import protocol as wire
from .backward import run_recorded
from ..protocol import TensorRef

__all__ = ["StraightLine", "build", "plain_row", "LOADING"]

_PLAIN = (TensorRef, int, float, bool, str, type(None), torch.dtype, ShardRegion)
_LITERALS = (int, bool, str, type(None))   # and finite floats: repr round-trips them exactly
MIN_ROWS = 2   # a run of fewer op rows goes through the per-command path, which runs one as fast
_NOT_IN_NAMES = re.compile(r"\W")
LOADING = -1   # the row index of the lines that load inputs from the table


def plain_row(command, peer_kernels) -> bool:
    """A RunOp whose kernel can be called with its inputs as the per-command path would pass them:
    tensors, scalars, dtypes, tuples or lists of those, and this rank's block (a ShardRegion)
    where the rule put one in the kwargs or inside a container. Recorded for backward or not."""
    return (type(command) is wire.RunOp and not command.input_steps and not command.moves
            and command.kernel not in peer_kernels
            and all(type(a) is not ShardRegion and _plain_value(a) for a in command.args)
            and all(type(key) is str and key.isidentifier() and not keyword.iskeyword(key) and _plain_value(value)
                    for key, value in command.kwargs.items()))


def _plain_value(value) -> bool:
    if type(value) in (tuple, list):
        return all(map(_plain_value, value))
    return type(value) in _PLAIN


class StraightLine:
    """A run of a graph's rows (first to stop - 1) as a function of the worker's tensor table."""

    def __init__(self, source: str, namespace: dict, name: str, row_of_line: list, rows: range, pure: tuple = (),
                 records: bool = False, hoisted: tuple = (), deferred: tuple = ()):
        self.source, self.name, self.row_of_line, self.rows = source, name, row_of_line, rows
        # rows of `rows` that the plan runs alone: factories before the function, the table's
        # part of frees after it (see the module's doc)
        self.hoisted, self.deferred = hoisted, deferred
        self.records = records   # some row records for backward (a training forward's)
        exec(compile(source, name, "exec"), namespace)   # noqa: S102 -- source built here from ids and names
        self.function = namespace["replay"]
        # For fusion.py: the run as a pure function of the tensors it loads, giving those it stores
        # (in `stores` order), as source; None where a row saves gathered parameters whole
        # (RunOp.regather False: some rank's piece is empty, and its outputs are joined to every
        # input). Compiled only for a graph that fuses (pure_function).
        self.loads, self.stores = pure[:2] if pure else ((), ())
        self.pure_source = pure[2] if pure else None
        self.namespace = namespace
        # so that a row's error report (its traceback) quotes the row's line
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)

    def pure_function(self):
        """The pure form as a function (fusion.py: a graph that fuses; replays never need it)."""
        exec(compile(self.pure_source, self.name + " fused", "exec"), self.namespace)   # noqa: S102 -- as above
        return self.namespace["fused"]

    def forget(self) -> None:
        """The graph was dropped."""
        linecache.cache.pop(self.name, None)

    def run(self, tensors: dict) -> tuple[int, Exception, dict] | None:
        """Run the rows; None when all ran. Otherwise (the failing row, its error, the values
        the rows before it left: id -> tensor), or (LOADING, KeyError, {}) if an input is missing.
        Grad mode is as before, whichever row stopped it."""
        grad_mode = torch.is_grad_enabled()
        try:
            self.function(tensors)
            return None
        except Exception as error:  # noqa: BLE001 -- a row's failure, handed to the worker's own handling
            frame, line = _generated_frame(error.__traceback__, self.name)
            row = self.row_of_line[line]
            made = {} if row == LOADING else {int(name[1:]): value for name, value in frame.f_locals.items()
                                              if name[0] == "t" and name[1:].isdigit()}
            return row, error, made
        finally:
            _set_grad_mode(grad_mode)


def _generated_frame(traceback, name: str):
    """The generated function's frame and the line it stopped on."""
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == name:
            found = traceback
        traceback = traceback.tb_next
    return found.tb_frame, found.tb_lineno


def build(graph_id: int, commands: list, scratch: tuple, random: frozenset, kernels: dict, is_plain,
          locate) -> tuple | None:
    """The graph's plan: its steps in row order, each a StraightLine (a run of plain rows) or a row
    index (a row for the per-command path); None if no run qualifies. `random`: the rows each
    replay shifts (they go alone); `is_plain(command)`: the worker's test; `locate(mesh_id)`: its
    placer of a ShardRegion on that mesh (None off it)."""
    steps, writer = [], None
    for index, command in enumerate(commands):
        if writer is not None and writer.take(index, command):
            if type(command) is wire.Factory:   # taken means hoisted: alone, before the run's function
                steps.append(index)
            continue
        _close(writer, steps, graph_id, None)
        writer = _Writer(kernels, is_plain, locate, random, index)
        taken = writer.take(index, command)
        if not taken or type(command) is wire.Factory:   # alone; or hoisted, alone before the function
            steps.append(index)
        if not taken:
            writer = None
    _close(writer, steps, graph_id, set(scratch))
    return tuple(steps) if any(type(step) is StraightLine for step in steps) else None


def _close(writer, steps: list, graph_id: int, scratch: set | None) -> None:
    """End a run: its function, or its rows one by one if it holds too few ops. `scratch`: the
    ids not to store (at the graph's end only: a later row may read any id a run made)."""
    if writer is None:
        return
    function = None
    if writer.ops >= MIN_ROWS:
        try:
            function = writer.finish(f"<dtorch graph {graph_id}, rows {writer.rows.start}-{writer.rows.stop - 1}>",
                                     scratch or set())
        except SyntaxError:   # a name the checks let through that Python will not take: the rows alone
            function = None
    if function is None:   # (its hoisted factories are steps already)
        steps.extend([row for row in writer.rows if row not in writer.hoisted])
    else:
        steps.append(function)
        steps.extend(writer.deferred)


class _Writer:
    """A run's lines, as rows are added in order."""

    def __init__(self, kernels: dict, is_plain, locate, random: frozenset, first: int):
        self.kernels, self.is_plain, self.locate, self.random = kernels, is_plain, locate, random
        self.rows = range(first, first)
        self.ops = 0
        self.loads: list = []      # ids read before any row made them, in first-use order
        self.loaded: set = set()
        self.alive: set = set()    # ids whose local variable holds a value now
        self.made: set = set()     # ids some row assigned
        self.gone: set = set()     # ids some Free row of the run freed
        self.hoisted: list = []    # Factory rows that run alone before the function
        self.deferred: list = []   # Free rows that run alone after it, for the table
        self.body: list = []       # (row index, line)
        self.pure_body: list = []  # the same lines for the pure form: a recorded row calls its kernel itself
        self.whole = False         # some row saves gathered parameters whole (RunOp.regather False): no pure form
        self.recording = False     # grad mode is on at this line (the run starts as the worker runs: off)
        self.recorded_any = False  # some line turns grad mode on: the function saves the mode first
        self.namespace: dict = {"_first": _first, "_outputs": _outputs, "_Tensor": torch.Tensor,
                                "_recorded": _recorded, "_recorded_whole": _recorded_whole,
                                "_grad_mode": _set_grad_mode, "_grad_enabled": torch.is_grad_enabled}

    def take(self, index: int, command) -> bool:
        """Add the row and say True, or False if it cannot join this run."""
        if type(command) is wire.Free:
            taken = self._free(index, command.ids)
        elif type(command) is wire.Factory:
            taken = self._hoist(index, command.out_id)
        else:
            plain = index not in self.random and self.is_plain(command)
            place = self.locate(command.mesh_id) if plain else None
            taken = place is not None and self._call(index, command, place)
        if taken:
            self.rows = range(self.rows.start, index + 1)
        return taken

    def _free(self, index: int, ids: tuple) -> bool:
        """`del` of what the run holds. Where the table held an id before the run, the replay
        form drops it from the table there too, and the Free goes again after the function
        (deferred): the pure form has no table, and the table's poison and in-flight marks are
        the per-command Free's to clear."""
        if not ids or any(i in self.gone for i in ids):
            return False   # it frees an id twice: the table's own Free words it
        held = [i for i in ids if i in self.alive]
        if held:
            self._line(index, "del " + ", ".join(f"t{i}" for i in held))
        tables = [i for i in ids if i in self.loaded or i not in self.made]
        if tables:
            self.body.append((index, "; ".join(f"tensors.pop({i}, None)" for i in tables)))
            self.deferred.append(index)
        self.alive.difference_update(ids)
        self.gone.update(ids)
        return True

    def _hoist(self, index: int, out_id: int) -> bool:
        """A factory that draws nothing, and whose id this run has not used, runs before it."""
        if index in self.random or out_id in self.loaded or out_id in self.made or out_id in self.gone:
            return False
        self.hoisted.append(index)
        return True

    def _line(self, index: int, line: str, pure: str | None = None) -> None:
        """A line of both forms (`pure`: the pure form's own, where they differ)."""
        self.body.append((index, line))
        self.pure_body.append((index, line if pure is None else pure))

    def _call(self, index: int, command: wire.RunOp, place) -> bool:
        if any(i in self.gone for i in _ids_in((command.args, command.kwargs.values()))):
            return False   # it reads an id a row of the run freed: row by row, which words the error
        if any(i in self.gone for i in command.out_ids):
            return False   # it makes an id again that a Free of the run let go: the deferred Free would drop it
        kernel = self.kernels.get(command.kernel)
        if kernel is None:
            return False
        name = f"k_{_NOT_IN_NAMES.sub('_', command.kernel)}_{index}"   # as a traceback quotes the line: k_sum_4(...)
        self.namespace[name] = kernel
        arguments = [self._source(a, place) for a in command.args]
        arguments += [f"{key}={self._source(value, place)}" for key, value in command.kwargs.items()]
        pure_call = call = f"{name}({', '.join(arguments)})"
        if command.grad:   # the tensors it may record against, depth-first as op_arguments.grad_inputs finds them
            inputs = "".join(f"t{i}, " for i in _ids_in((command.args, command.kwargs.values())))
            recorder = "_recorded" if command.regather else "_recorded_whole"
            call = f"{recorder}({name}, ({inputs}), {', '.join(arguments)})"
            self.whole |= not command.regather
        if command.grad != self.recording:   # (the run's own mode: the worker's, off)
            self.recording = command.grad
            self.recorded_any |= command.grad
            self._line(index, "_grad_mode(True)" if command.grad else "_grad_mode(grad_mode)",
                       "_grad_mode(True)" if command.grad else "_grad_mode(False)")
        outs = [f"t{i}" for i in command.out_ids]
        if len(outs) == 1:   # a kernel's tuple result with one id keeps its first item, as LocalShards.store does
            self._line(index, f"{outs[0]} = {call}", f"{outs[0]} = {pure_call}")
            self._line(index, f"if {outs[0]}.__class__ is not _Tensor: {outs[0]} = _first({outs[0]})")
        else:
            self._line(index, f"{', '.join(outs)} = _outputs({call}, {len(outs)})",
                       f"{', '.join(outs)} = _outputs({pure_call}, {len(outs)})")
        self.alive.update(command.out_ids)
        self.made.update(command.out_ids)
        self.ops += 1
        return True

    def _source(self, value, place) -> str:
        """An argument as source. A tuple or list becomes a list display, built anew per call, as
        the per-command path rebuilds containers (as lists) around the tensors it finds; a
        ShardRegion becomes this rank's block, as the per-command path places it."""
        if type(value) in (tuple, list):
            return "[" + ", ".join(self._source(v, place) for v in value) + "]"
        if type(value) is TensorRef:
            if value.id not in self.made and value.id not in self.loaded:
                self.loads.append(value.id)
                self.loaded.add(value.id)
                self.alive.add(value.id)
            return f"t{value.id}"
        if type(value) is ShardRegion:
            return self._exact(place(value))
        return self._exact(value)

    def _exact(self, value) -> str:
        """A value as source that builds an equal one, tuples as tuples (a placed block)."""
        if type(value) is tuple:
            return "(" + "".join(self._exact(v) + ", " for v in value) + ")"
        if type(value) is list:
            return "[" + ", ".join(map(self._exact, value)) + "]"
        if type(value) in _LITERALS or (type(value) is float and math.isfinite(value)):
            return repr(value)
        name = f"c{len(self.namespace)}"   # a dtype, an inf or a nan: a name bound to it
        self.namespace[name] = value
        return name

    def finish(self, name: str, scratch: set) -> StraightLine:
        lines = ["def replay(tensors):"]
        row_of_line = [LOADING, LOADING]   # line numbers start at 1, then the def line
        for tensor_id in self.loads:
            lines.append(f"    t{tensor_id} = tensors[{tensor_id}]")
            row_of_line.append(LOADING)
        if self.recording:   # back to the mode the run started in
            self._line(self.body[-1][0], "_grad_mode(grad_mode)", "_grad_mode(False)")
        if self.recorded_any:
            lines.append("    grad_mode = _grad_enabled()")
            row_of_line.append(LOADING)
        for index, line in self.body:
            lines.append("    " + line)
            row_of_line.append(index)
        stored = sorted(i for i in self.alive if i in self.made and i not in scratch)
        for tensor_id in stored:
            lines.append(f"    tensors[{tensor_id}] = t{tensor_id}")
            row_of_line.append(self.body[-1][0])   # (a store cannot raise)
        pure = () if self.whole else (tuple(self.loads), tuple(stored), self._pure_source(stored))
        return StraightLine("\n".join(lines) + "\n", self.namespace, name, row_of_line, self.rows, pure,
                            self.recorded_any, tuple(self.hoisted), tuple(self.deferred))

    def _pure_source(self, stored: list) -> str:
        """The same rows as `fused(t3, t7) -> (t9, t12)`: no table, so torch.compile can trace it.
        A recorded row calls its kernel with grad mode on, so that torch.compile's AOTAutograd
        records the whole run as one node whose backward is compiled too (fusion.py). fusion.py
        calls a recording run with grad mode on (see FusedRun._call); its rows start in the
        worker's mode, off."""
        lines = [f"def fused({', '.join(f't{i}' for i in self.loads)}):"]
        if self.recorded_any:
            lines.append("    _grad_mode(False)")
        lines += ["    " + line for _, line in self.pure_body]
        lines.append(f"    return ({''.join(f't{i}, ' for i in stored)})")
        return "\n".join(lines) + "\n"


def _ids_in(value):
    """The ids of the TensorRefs in an argument, at any depth."""
    if type(value) is TensorRef:
        yield value.id
    elif isinstance(value, (tuple, list, type({}.values()))):
        for item in value:
            yield from _ids_in(item)


def _recorded(kernel, candidates: tuple, /, *args, **kwargs):
    """A row recorded for backward, as Worker._run_op runs one (grad mode is on)."""
    return run_recorded(kernel, [tensor for tensor in candidates if tensor.requires_grad], args, kwargs)


def _recorded_whole(kernel, candidates: tuple, /, *args, **kwargs):
    """... one whose RunOp.regather is False: gathered parameters are saved whole."""
    return run_recorded(kernel, [tensor for tensor in candidates if tensor.requires_grad], args, kwargs, False)


_set_grad_mode = torch._C._set_grad_enabled


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _outputs(result, count: int) -> tuple:
    """A multi-output kernel's results, one per id (a kernel that gives fewer fails its row)."""
    if not isinstance(result, (tuple, list)) or len(result) < count:
        raise ValueError(f"the kernel gave {type(result).__name__} where the op has {count} outputs")
    return tuple(result[:count])
