"""A worker's compiled graphs (dtorch.compile): the commands one captured call issued, kept under
a graph id and run again by one RunGraph command.

A replay runs the captured commands unchanged, with the capture's own tensor ids. Only the ids at
the edges move: before the rows run, each capture input id is bound to the tensor RunGraph names;
after, each capture output id moves to its RunGraph out id, and every id the call made and dropped
(scratch) is freed. Ids the capture found already bound (the user still holds an input or an
output of the first call) are set aside for the replay and put back after it, so a replay never
disturbs a live tensor. Ids the call made and left alive (gradients, optimizer state) are
"persistent": each replay writes them in place, as the capture did.

What changes from call to call travels in RunGraph: the global random stream's seed and how far
its counter moved (random rows draw fresh numbers, equal to eager's), and each optimizer row's
step count."""
from __future__ import annotations

from typing import NamedTuple

from . import protocol as wire


class Graph(NamedTuple):
    commands: list        # decoded rows, seqs as captured
    inputs: tuple
    outputs: tuple
    scratch: tuple
    random: frozenset     # row indexes that drew from the global random stream
    steps: tuple          # row indexes of OptimizerStep rows, in RunGraph.step_shifts order


def define(command: wire.DefineGraph) -> Graph:
    commands = wire.decode_rows(command.rows)
    rows = range(len(commands))
    if not all(i in rows for i in command.random + command.steps):
        raise ValueError(f"graph {command.graph_id}: a random or step row index outside its {len(commands)} rows")
    if not all(type(commands[i]) is wire.OptimizerStep for i in command.steps):
        raise ValueError(f"graph {command.graph_id}: a step row that is not an OptimizerStep")
    return Graph(commands, command.inputs, command.outputs, command.scratch, frozenset(command.random), command.steps)


def replay_commands(graph: Graph, run: wire.RunGraph) -> list:
    """The rows as commands of this replay: row i as seq run.seq + i, random and step rows shifted."""
    if run.span != len(graph.commands):
        raise ValueError(f"RunGraph spans {run.span} commands; graph {run.graph_id} holds {len(graph.commands)}")
    if len(run.step_shifts) != len(graph.steps):
        raise ValueError(f"RunGraph gives {len(run.step_shifts)} step shifts for {len(graph.steps)} optimizer rows")
    shifts = dict(zip(graph.steps, run.step_shifts))
    commands = []
    for i, command in enumerate(graph.commands):
        command = command._replace(seq=run.seq + i)
        if i in graph.random:
            command = _shift_random(command, run.seed, run.random_shift)
        elif i in shifts:
            command = command._replace(steps=tuple(s + shifts[i] for s in command.steps))
        commands.append(command)
    return commands


def _shift_random(command, seed: int, shift: int):
    """A random factory's args start (seed, counter, ...); a random op (dropout) takes seed and
    counter as kwargs or as its last two positional args (dtorch/capture.py)."""
    if type(command) is wire.Factory:
        _, counter, *rest = command.args
        return command._replace(args=(seed, counter + shift, *rest))
    if "counter" in command.kwargs:
        return command._replace(kwargs=dict(command.kwargs, seed=seed, counter=command.kwargs["counter"] + shift))
    *rest, _, counter = command.args
    return command._replace(args=(*rest, seed, counter + shift))


class Bindings:
    """The worker's id tables (tensors, poisoned, in flight) around one replay."""

    def __init__(self, tables: tuple):
        self.tables = tables
        self.set_aside: list = []

    def set_aside_ids(self, ids) -> None:
        for tensor_id in ids:
            held = tuple(table.pop(tensor_id, _NONE) for table in self.tables)
            if any(h is not _NONE for h in held):
                self.set_aside.append((tensor_id, held))

    def copy(self, source: int, target: int) -> None:
        for table in self.tables:
            value = table.get(source, _NONE)
            if value is not _NONE:
                table[target] = value

    def move(self, source: int, target: int) -> None:
        for table in self.tables:
            value = table.pop(source, _NONE)
            if value is not _NONE:
                table[target] = value

    def drop(self, ids) -> None:
        for tensor_id in ids:
            for table in self.tables:
                table.pop(tensor_id, None)

    def put_back(self) -> None:
        for tensor_id, held in self.set_aside:
            for table, value in zip(self.tables, held):
                if value is not _NONE:
                    table[tensor_id] = value


_NONE = object()


def replay(graph: Graph, run: wire.RunGraph, tables: tuple, execute) -> None:
    """Run one replay through `execute` (the worker's own per-command path: its errors, poison and
    profiling apply to each row as to any command)."""
    commands = replay_commands(graph, run)
    if len(run.input_ids) != len(graph.inputs) or len(run.out_ids) != len(graph.outputs):
        raise ValueError(f"RunGraph names {len(run.input_ids)} inputs and {len(run.out_ids)} outputs; graph "
                         f"{run.graph_id} takes {len(graph.inputs)} and gives {len(graph.outputs)}")
    bindings = Bindings(tables)
    bindings.set_aside_ids(set(graph.inputs + graph.outputs + graph.scratch) - set(run.input_ids))
    for captured, given in zip(graph.inputs, run.input_ids):
        bindings.copy(given, captured)
    for command in commands:
        execute(command)
    for captured, given in zip(graph.inputs, run.input_ids):
        if captured != given:   # a row may have rebound an input (an in-place op): the caller's id follows
            bindings.move(captured, given)
    for captured, given in zip(graph.outputs, run.out_ids):
        bindings.move(captured, given)
    bindings.drop(graph.scratch)
    bindings.put_back()
