"""A compiled graph of plain ops as one generated Python function: each row a line that calls its
kernel on local variables, so a replay pays for the ops and little else.

A replay through the worker's per-command path builds each row's command, finds its inputs in the
id table, runs the kernel and stores the result back in the table: about 2 us of Python per row,
as much as a small op itself. Here a row is one line, `t12 = k_mul(t11, 1.0001)`, its tensors
local variables and a Free row a `del`; the ids the rows read before making them are loaded from
the table first, and the ids still alive at the end are stored back, except scratch, which the
replay would drop. The table then holds exactly what running the rows one by one leaves in it.

Only graphs whose every row is a plain op or a Free qualify (`plain_row`: tensors and scalars in,
no grad, no peers, no slicing, nothing random, on a mesh that holds this rank); any other graph
replays row by row. A replay takes this path only when no communication is in flight.

A row that raises stops the function. Its line names the row, and the function's frame (kept by
the traceback) holds what the rows before it made: those go into the table, the failing row
poisons its outputs and is reported under its own seq, and the rows after it run on the per-command
path, which spreads the poison as in eager. A missing input (freed, or poisoned) raises before
any row runs, and the whole replay goes row by row, which words that error."""
from __future__ import annotations

import linecache
import math
import re

import torch

from . import protocol as wire
from .protocol import TensorRef

__all__ = ["StraightLine", "build", "plain_row"]

_PLAIN = (TensorRef, int, float, bool, str, type(None), torch.dtype)
_NOT_IN_NAMES = re.compile(r"\W")
LOADING = -1   # the row index of the lines that load inputs from the table


def plain_row(command, peer_kernels) -> bool:
    """A RunOp whose kernel can be called with its inputs as the per-command path would pass them:
    tensors, scalars, dtypes, and tuples or lists of those; nothing rank-local to place."""
    return (type(command) is wire.RunOp and not command.grad and not command.input_steps
            and command.kernel not in peer_kernels and all(map(_plain_value, command.args))
            and all(type(key) is str and key.isidentifier() and _plain_value(value)
                    for key, value in command.kwargs.items()))


def _plain_value(value) -> bool:
    if type(value) in (tuple, list):
        return all(map(_plain_value, value))
    return type(value) in _PLAIN


class StraightLine:
    """One graph's rows as a function of the worker's tensor table."""

    def __init__(self, source: str, namespace: dict, name: str, row_of_line: list):
        self.source, self.name, self.row_of_line = source, name, row_of_line
        exec(compile(source, name, "exec"), namespace)   # noqa: S102 -- source built here from ids and names
        self.function = namespace["replay"]
        # so that a row's error report (its traceback) quotes the row's line
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)

    def forget(self) -> None:
        """The graph was dropped."""
        linecache.cache.pop(self.name, None)

    def run(self, tensors: dict) -> tuple[int, Exception, dict] | None:
        """Run every row; None when all ran. Otherwise (the failing row, its error, the values
        the rows before it left: id -> tensor), or (LOADING, KeyError, {}) if an input is missing."""
        try:
            self.function(tensors)
            return None
        except Exception as error:  # noqa: BLE001 -- a row's failure, handed to the worker's own handling
            frame, line = _generated_frame(error.__traceback__, self.name)
            row = self.row_of_line[line]
            made = {} if row == LOADING else {int(name[1:]): value for name, value in frame.f_locals.items()
                                              if name[0] == "t" and name[1:].isdigit()}
            return row, error, made


def _generated_frame(traceback, name: str):
    """The generated function's frame and the line it stopped on."""
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == name:
            found = traceback
        traceback = traceback.tb_next
    return found.tb_frame, found.tb_lineno


def build(graph_id: int, commands: list, scratch: tuple, kernels: dict, is_plain, is_member) -> StraightLine | None:
    """The function for these rows, or None if a row does not qualify (then the graph replays row
    by row). `is_plain(command)` and `is_member(mesh_id)` are the worker's own tests."""
    writer = _Writer(kernels)
    for index, command in enumerate(commands):
        if type(command) is wire.Free:
            written = writer.free(index, command.ids)
        elif is_plain(command) and is_member(command.mesh_id):
            written = writer.call(index, command)
        else:
            written = False
        if not written:
            return None
    return writer.finish(f"<dtorch graph {graph_id}>", set(scratch))


class _Writer:
    """The function's lines, as rows are added in order."""

    def __init__(self, kernels: dict):
        self.kernels = kernels
        self.loads: list = []      # ids read before any row made them, in first-use order
        self.alive: set = set()    # ids whose local variable holds a value now
        self.made: set = set()     # ids some row assigned
        self.body: list = []       # (row index, line)
        self.namespace: dict = {"_first": _first, "_outputs": _outputs, "_Tensor": torch.Tensor}

    def free(self, index: int, ids: tuple) -> bool:
        if not all(i in self.alive and i in self.made and i not in self.loads for i in ids):
            return False   # it frees an id the table held before the rows (or twice): row by row
        self.alive.difference_update(ids)
        self.body.append((index, "del " + ", ".join(f"t{i}" for i in ids)))
        return True

    def call(self, index: int, command: wire.RunOp) -> bool:
        if any(i in self.made and i not in self.alive for i in _ids_in((command.args, command.kwargs.values()))):
            return False   # it reads an id a row made and freed: row by row, which words the error
        kernel = self.kernels.get(command.kernel)
        if kernel is None:
            return False
        name = f"{_NOT_IN_NAMES.sub('_', command.kernel)}_{index}"   # as a traceback quotes the line: sum_4(...)
        self.namespace[name] = kernel
        arguments = [self._source(a) for a in command.args]
        arguments += [f"{key}={self._source(value)}" for key, value in command.kwargs.items()]
        call = f"{name}({', '.join(arguments)})"
        outs = [f"t{i}" for i in command.out_ids]
        if len(outs) == 1:   # a kernel's tuple result with one id keeps its first item, as Worker._store does
            self.body += [(index, f"{outs[0]} = {call}"),
                          (index, f"if {outs[0]}.__class__ is not _Tensor: {outs[0]} = _first({outs[0]})")]
        else:
            self.body.append((index, f"{', '.join(outs)} = _outputs({call}, {len(outs)})"))
        self.alive.update(command.out_ids)
        self.made.update(command.out_ids)
        return True

    def _source(self, value) -> str:
        """An argument as source. A tuple or list becomes a list display, built anew per call, as
        the per-command path rebuilds containers (as lists) around the tensors it finds."""
        if type(value) in (tuple, list):
            return "[" + ", ".join(map(self._source, value)) + "]"
        if type(value) is TensorRef:
            if value.id not in self.made and value.id not in self.loads:
                self.loads.append(value.id)
                self.alive.add(value.id)
            return f"t{value.id}"
        if type(value) in (int, bool, str, type(None)) or (type(value) is float and math.isfinite(value)):
            return repr(value)   # the literal: repr round-trips these exactly
        name = f"c{len(self.namespace)}"   # a dtype, an inf or a nan: a name bound to it
        self.namespace[name] = value
        return name

    def finish(self, name: str, scratch: set) -> StraightLine:
        lines = ["def replay(tensors):"]
        row_of_line = [LOADING, LOADING]   # line numbers start at 1, then the def line
        for tensor_id in self.loads:
            lines.append(f"    t{tensor_id} = tensors[{tensor_id}]")
            row_of_line.append(LOADING)
        for index, line in self.body:
            lines.append("    " + line)
            row_of_line.append(index)
        stored = sorted(i for i in self.alive if i in self.made and i not in scratch)
        for tensor_id in stored:
            lines.append(f"    tensors[{tensor_id}] = t{tensor_id}")
            row_of_line.append(self.body[-1][0])   # (a store cannot raise)
        return StraightLine("\n".join(lines) + "\n", self.namespace, name, row_of_line)


def _ids_in(value):
    """The ids of the TensorRefs in an argument, at any depth."""
    if type(value) is TensorRef:
        yield value.id
    elif isinstance(value, (tuple, list, type({}.values()))):
        for item in value:
            yield from _ids_in(item)


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _outputs(result, count: int) -> tuple:
    """A multi-output kernel's results, one per id (a kernel that gives fewer fails its row)."""
    if not isinstance(result, (tuple, list)) or len(result) < count:
        raise ValueError(f"the kernel gave {type(result).__name__} where the op has {count} outputs")
    return tuple(result[:count])
