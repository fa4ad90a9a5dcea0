"""A worker's compiled graphs (dtorch.compile): the commands one captured call issued, kept under
a graph id and run again by one RunGraph command.

A replay runs the captured commands unchanged, with the capture's own tensor ids. Only the ids at
the edges move: before the rows run, each capture input id is bound to the tensor RunGraph names;
after, each capture output id moves to its RunGraph out id, and every id the call made and dropped
(scratch) is freed. Ids the capture found already bound (the user still holds an input or an
output of the first call) are set aside for the replay and put back after it, so a replay never
disturbs a live tensor. That includes a RunGraph input id that is one of the graph's own (the
caller passes back what the first call returned, `state = step(state)`): it is bound as its input
first, then set aside; and the moves at the end take every value out before writing any. Ids the
call made and left alive (gradients, optimizer state) are "persistent": each replay writes them
in place, as the capture did. A tensor from before the call that the call changed in place (an
EMA) is bound by the id it holds, which is such a persistent id: the rows write it, and the bound
input does not move back over it; the captured input id, left with the old value, is dropped.

What changes from call to call travels in RunGraph: the global random stream's seed and how far
its counter moved (random rows draw fresh numbers, equal to eager's), each optimizer row's step
count and the hyperparameters that differ from the row's (an lr schedule), and the numbers the
compiled function takes as inputs, each put at the operands the capture found it in.

The rows run by the graph's plan where the worker built one (runs of plain rows as generated
functions, straight_line.py), else one by one through the worker's per-command path; either way
the id tables end as running the rows one by one leaves them."""
from __future__ import annotations

from typing import NamedTuple

from .. import protocol as wire
from . import straight_line


class Graph(NamedTuple):
    commands: list        # decoded rows, seqs as captured
    inputs: tuple
    outputs: tuple
    scratch: tuple
    random: frozenset     # row indexes a replay rewrites: they run alone, never inside a run's function
                          # (straight_line.build): the draws, and the rows with scalar slots
    steps: tuple          # row indexes of OptimizerStep rows, in RunGraph.step_shifts order
    rows: tuple           # per row, (its command type, its fields after seq): a replay's commands are
                          # built from these with one tuple.__new__ each (NamedTuple._replace costs ~1 us)
    edges: set            # inputs, outputs and scratch: ids a replay sets aside if they are bound
                          # (sets, not frozensets: see _bound)
    plan: tuple | None = None   # its steps: runs of plain rows as functions, other rows alone (straight_line.py)
    draws: frozenset = frozenset()   # row indexes that drew from the global random stream
    scalars: dict | None = None      # row index -> ((argument index, k), ...): args[i] = RunGraph.scalars[k]
    scalar_count: int = 0            # how many numbers a RunGraph must give
    scratch_ids: set = set()         # scratch as a set, for _bound


def define(command: wire.DefineGraph) -> Graph:
    commands = wire.decode_rows(command.rows)
    rows = range(len(commands))
    if not all(i in rows for i in command.random + command.steps):
        raise ValueError(f"graph {command.graph_id}: a random or step row index outside its {len(commands)} rows")
    if not all(type(commands[i]) is wire.OptimizerStep for i in command.steps):
        raise ValueError(f"graph {command.graph_id}: a step row that is not an OptimizerStep")
    scalars = _scalar_slots(command, commands)
    return Graph(commands, command.inputs, command.outputs, command.scratch,
                 frozenset(command.random) | frozenset(scalars), command.steps,
                 tuple([_row(c) for c in commands]),
                 set(command.inputs + command.outputs + command.scratch),
                 draws=frozenset(command.random), scalars=scalars,
                 scalar_count=1 + max((k for _, _, k in command.scalars), default=-1),
                 scratch_ids=set(command.scratch))


def _row(command) -> tuple:
    """A command as Graph.rows holds it: its type and its fields after seq."""
    return (type(command), tuple(command)[1:])


def with_commands(graph: Graph, changed: dict) -> Graph:
    """The graph with the rows in `changed` (row index -> command) replaced, in the commands and
    in the rows a replay builds from."""
    commands, rows = list(graph.commands), list(graph.rows)
    for i, command in changed.items():
        commands[i], rows[i] = command, _row(command)
    return graph._replace(commands=type(graph.commands)(commands), rows=tuple(rows))


def _scalar_slots(command: wire.DefineGraph, commands: list) -> dict:
    slots: dict = {}
    for slot in command.scalars:
        if not (type(slot) is tuple and len(slot) == 3 and all(type(v) is int and v >= 0 for v in slot)
                and slot[0] < len(commands) and type(commands[slot[0]]) is wire.RunOp
                and slot[1] < len(commands[slot[0]].args)):
            raise ValueError(f"graph {command.graph_id}: a scalar slot {slot!r} that names no RunOp operand")
        row, position, k = slot
        slots.setdefault(row, []).append((position, k))
    return {row: tuple(uses) for row, uses in slots.items()}


def _check(graph: Graph, run: wire.RunGraph) -> None:
    if run.span != len(graph.commands):
        raise ValueError(f"RunGraph spans {run.span} commands; graph {run.graph_id} holds {len(graph.commands)}")
    if len(run.step_shifts) != len(graph.steps) or len(run.hypers) not in (0, len(graph.steps)):
        raise ValueError(f"RunGraph gives {len(run.step_shifts)} step shifts and {len(run.hypers)} hyperparameter "
                         f"sets for {len(graph.steps)} optimizer rows")
    # (the element checks only where there are elements: a generator costs ~0.3 us per replay)
    if len(run.scalars) != graph.scalar_count or (run.scalars and not all(type(v) in (int, float)
                                                                           for v in run.scalars)):
        raise ValueError(f"RunGraph gives {len(run.scalars)} numbers ({run.scalars!r:.80}); graph {run.graph_id} "
                         f"takes {graph.scalar_count}")
    if run.hypers and not all(type(hyper) is dict for hyper in run.hypers):
        raise ValueError(f"RunGraph's hyperparameters are not dicts: {run.hypers!r:.80}")
    if len(run.input_ids) != len(graph.inputs) or len(run.out_ids) != len(graph.outputs):
        raise ValueError(f"RunGraph names {len(run.input_ids)} inputs and {len(run.out_ids)} outputs; graph "
                         f"{run.graph_id} takes {len(graph.inputs)} and gives {len(graph.outputs)}")


def replay_commands(graph: Graph, run: wire.RunGraph) -> list:
    """The rows as commands of this replay: row i as seq run.seq + i, random and step rows shifted."""
    _check(graph, run)
    new, first = tuple.__new__, run.seq
    commands = [new(kind, (first + i,) + fields) for i, (kind, fields) in enumerate(graph.rows)]
    for i in graph.random:
        commands[i] = _rewritten(graph, run, i, commands[i])
    for k, i in enumerate(graph.steps):
        commands[i] = _step_row(commands[i], run, k)
    return commands


def replay_command(graph: Graph, run: wire.RunGraph, i: int):
    """Row i alone as a command of this replay, as replay_commands makes it."""
    kind, fields = graph.rows[i]
    command = tuple.__new__(kind, (run.seq + i,) + fields)
    if i in graph.random:
        return _rewritten(graph, run, i, command)
    if i in graph.steps:
        return _step_row(command, run, graph.steps.index(i))
    return command


def _rewritten(graph: Graph, run: wire.RunGraph, i: int, command):
    """A row with fresh random numbers, or the call's numbers at its scalar slots."""
    if i in graph.draws:
        command = _shift_random(command, run.seed, run.random_shift)
    uses = graph.scalars.get(i) if graph.scalars else None
    if uses:
        args = list(command.args)
        for position, k in uses:
            args[position] = run.scalars[k]
        command = command._replace(args=tuple(args))
    return command


def _step_row(command: wire.OptimizerStep, run: wire.RunGraph, k: int) -> wire.OptimizerStep:
    """Optimizer row k with this replay's step counts and hyperparameters (an lr schedule's lr)."""
    shift, hyper = run.step_shifts[k], run.hypers[k] if run.hypers else None
    return command._replace(steps=tuple([s + shift for s in command.steps]),
                            hyper={**command.hyper, **hyper} if hyper else command.hyper)


def _shift_random(command, seed: int, shift: int):
    """A random factory's args start (seed, counter, ...); a random op (dropout) takes seed and
    counter as kwargs or as its last two positional args (dtorch/dtensor/compile_capture.py)."""
    if type(command) is wire.Factory:
        _, counter, *rest = command.args
        return command._replace(args=(seed, counter + shift, *rest))
    if "counter" in command.kwargs:
        return command._replace(kwargs=dict(command.kwargs, seed=seed, counter=command.kwargs["counter"] + shift))
    *rest, _, counter = command.args
    return command._replace(args=(*rest, seed, counter + shift))


class Bindings:
    """The worker's id tables (tensors, poisoned, in flight) around one replay.

    A graph names ~1 scratch id per op (100 for a 100-op chain), and a table holds what the
    program keeps now, which for a fused chain is a handful: setting aside and dropping look up
    whichever of the two is smaller (_bound), so a replay whose scratch never reaches the table
    pays per id it holds, not per id the graph names (12 us of a fused 100-op chain's 45)."""

    def __init__(self, tables: tuple):
        self.tables = tables
        self.set_aside: list = []

    def set_aside_ids(self, ids: set, keep=()) -> None:
        """Take every id of `ids` but those in `keep` out of the tables, to put back after."""
        bound = set()
        for table in self.tables:
            if table:
                bound.update(_bound(table, ids))
        bound.difference_update(keep)
        for tensor_id in bound:
            self.set_aside.append((tensor_id, tuple([table.pop(tensor_id, _NONE) for table in self.tables])))

    def copy_all(self, pairs: list) -> None:
        """table[target] = table[source] for every (source, target) pair at once: every source
        is read before any target is written, so a target that is another pair's source (a
        caller's id equal to one of the graph's own) cannot change what that pair copies."""
        for table in self.tables:
            if table:
                values = [(target, table.get(source, _NONE)) for source, target in pairs]
                table.update((target, value) for target, value in values if value is not _NONE)

    def move_all(self, pairs: list) -> list:
        """Take each (source, target) pair's entries out of the tables, all sources first; returns
        them for write(), which puts them at the targets."""
        return [[(target, table.pop(source, _NONE)) for source, target in pairs] if table else ()
                for table in self.tables]

    def write(self, taken: list) -> None:
        for table, values in zip(self.tables, taken):
            table.update((target, value) for target, value in values if value is not _NONE)

    def drop(self, ids) -> None:
        for table in self.tables:
            if table:
                for tensor_id in [*filter(table.__contains__, ids)]:
                    del table[tensor_id]

    def drop_set(self, ids: set) -> None:
        """drop() for a set of ids (a graph's scratch), at the cost of the smaller side."""
        for table in self.tables:
            if table:
                for tensor_id in _bound(table, ids):
                    del table[tensor_id]

    def put_back(self) -> None:
        for tensor_id, held in self.set_aside:
            for table, value in zip(self.tables, held):
                if value is not _NONE:
                    table[tensor_id] = value


def _bound(table: dict, ids: set) -> set:
    """The ids of `ids` that `table` holds, iterating over the smaller of the two, in C. `ids`
    must be an exact set: CPython's dict-view intersection hands over to set.intersection (which
    iterates the other side) only for one, and walks a frozenset whole."""
    return table.keys() & ids


_NONE = object()


def _run_plan(graph: Graph, run: wire.RunGraph, tensors: dict, execute, fail, straight) -> None:
    """Each step in turn: a row through `execute`, a run of rows as its function where
    `straight(seq of its first row)` allows. If a function's row raises, what the rows before it made goes into the
    table, that row fails as a command would, and every row after it runs one by one."""
    one_by_one = lambda rows: [execute(replay_command(graph, run, i)) for i in rows]   # noqa: E731
    for step in graph.plan:
        if type(step) is int:
            execute(replay_command(graph, run, step))
            continue
        stopped = step.run(tensors) if straight(run.seq + step.rows.start) else (straight_line.LOADING, None, None)
        if stopped is None:
            continue
        row, error, made = stopped
        if row == straight_line.LOADING:   # not run: an input is missing (the per-command path words why)
            one_by_one([i for i in step.rows if i not in step.hoisted])   # (its deferred Frees run again after)
            continue
        tensors.update(made)
        fail(replay_command(graph, run, row), error)
        # the table's part of the run's Frees before that row, then every row after it but the
        # factories that ran before the function
        one_by_one([i for i in step.deferred if i < row])
        one_by_one([i for i in range(row + 1, len(graph.rows)) if i not in step.hoisted])
        return


def replay(graph: Graph, run: wire.RunGraph, tables: tuple, execute, fail, straight) -> None:
    """Run one replay: by graph.plan where the graph has one, else row by row through `execute`
    (the worker's own per-command path: its errors, poison and profiling apply to each row as to
    any command). `fail(command, error)` is the worker's handling of a command that raised (for
    a row of a run's function); `straight(seq)` says whether a run starting at that seq may take
    its function now."""
    _check(graph, run)
    if nothing_to_set_aside(graph, run, tables):
        _replay_clear(graph, run, tables, execute, fail, straight)
    else:
        _replay_setting_aside(graph, run, tables, execute, fail, straight)


def nothing_to_set_aside(graph: Graph, run: wire.RunGraph, tables: tuple) -> bool:
    """No id of the graph is in any table, none of the caller's ids is one of the graph's, and
    none of them is poisoned or in flight: the common call (`z = step(z)`, with ids the caller
    made since), also in a session that holds a poisoned tensor elsewhere."""
    edges, given = graph.edges, run.input_ids
    tensors, poisoned, in_flight = tables
    # (a dict view's isdisjoint walks the smaller side when the other is a set, and builds nothing)
    return (edges.isdisjoint(given) and tensors.keys().isdisjoint(edges)
            and _untouched(poisoned, edges, given) and _untouched(in_flight, edges, given))


def _untouched(table: dict, edges: set, given: tuple) -> bool:
    """No id of the graph, nor any of the caller's, in this poisoned or in-flight table."""
    return not table or (table.keys().isdisjoint(edges) and table.keys().isdisjoint(given))


def _run_rows(graph: Graph, run: wire.RunGraph, tensors: dict, execute, fail, straight) -> None:
    if graph.plan is not None:
        _run_plan(graph, run, tensors, execute, fail, straight)
    else:
        for command in replay_commands(graph, run):
            execute(command)


def _replay_setting_aside(graph: Graph, run: wire.RunGraph, tables: tuple, execute, fail, straight) -> None:
    """replay() where an id must step aside for the rows (see the module's doc)."""
    bindings = Bindings(tables)
    bindings.set_aside_ids(graph.edges, keep=run.input_ids)
    bindings.copy_all(list(zip(run.input_ids, graph.inputs)))
    # A caller's id that is also one the graph makes (the caller passes back the tensor an
    # in-place op of the first call rebound, whose id is the graph's output): bound as its input
    # now, it steps aside too, so the rows that write that id do not overwrite the caller's tensor.
    clash = graph.edges.intersection(run.input_ids)
    if clash:
        bindings.set_aside_ids(clash.difference(graph.inputs))
    tensors = tables[0]
    held = {given: tensors.get(given) for given in run.input_ids if given not in graph.edges}
    _run_rows(graph, run, tensors, execute, fail, straight)
    # The caller's input ids follow their captured ids (a row may have written an input in place:
    # an optimizer step), unless the rows wrote the caller's id itself: a tensor from before the
    # call that the call changed in place (an EMA) is passed as its old id and written at its
    # persistent one, which is what the caller holds. The outputs go to their new ids; all taken
    # out first, since a caller's id can be one of the graph's.
    follows = [(captured, given) for captured, given in zip(graph.inputs, run.input_ids)
               if captured != given and (given not in held or tensors.get(given) is held[given])]
    taken = bindings.move_all(follows + list(zip(graph.outputs, run.out_ids)))
    bindings.drop_set(graph.scratch_ids)
    # A captured input id that did not follow (the rows wrote the caller's id: an EMA, a gradient
    # replaced by the backward) holds the old value, which the caller no longer names: dropped.
    bindings.drop([captured for captured, given in zip(graph.inputs, run.input_ids)
                   if captured != given and captured not in run.input_ids])
    bindings.put_back()
    bindings.write(taken)


def _replay_clear(graph: Graph, run: wire.RunGraph, tables: tuple, execute, fail, straight) -> None:
    """replay() where nothing_to_set_aside: the same moves on the one table, without Bindings'
    passes over three (the worker's part of a fused chain's call, around its compiled function:
    14.5 us instead of 20.9, benchmarks/fused_overhead.py). Where a tensor is poisoned or in
    flight now, Bindings ends it on every table."""
    tensors = tables[0]
    held = [tensors.get(given, _NONE) for given in run.input_ids]
    tensors.update([(captured, value) for captured, value in zip(graph.inputs, held) if value is not _NONE])
    _run_rows(graph, run, tensors, execute, fail, straight)
    # as _replay_setting_aside's end, where no caller's id is one of the graph's: each captured
    # input id goes, to its caller's id where the rows left that as it was
    moves = [(captured, given) for captured, given, value in zip(graph.inputs, run.input_ids, held)
             if tensors.get(given, _NONE) is value]
    moves += zip(graph.outputs, run.out_ids)
    if tables[1] or tables[2]:
        bindings = Bindings(tables)
        taken = bindings.move_all(moves)
        bindings.drop_set(graph.scratch_ids)
        bindings.drop(graph.inputs)
        bindings.write(taken)
        return
    taken = [(target, tensors.pop(source, _NONE)) for source, target in moves]
    for tensor_id in _bound(tensors, graph.scratch_ids):
        del tensors[tensor_id]
    for captured in graph.inputs:
        tensors.pop(captured, None)
    tensors.update([(target, value) for target, value in taken if value is not _NONE])
