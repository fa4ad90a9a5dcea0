"""dtorch.compile: capture a function's commands once, replay them with one command per call
(docs/design/compile.md).

    @dtorch.compile
    def step(x, y):
        return (x @ w + y).relu().sum(dim=0)

The first call with a signature (each DTensor argument's shape, dtype, mesh, placements and
requires_grad, and its grad's kind; every other argument's value; grad mode; torch.autocast's
state) runs `step` as eager code would, and records the commands it issues (dtorch/dtensor/compile_capture.py).
Later calls with that signature send ONE RunGraph command: the workers run the recorded commands
on the new arguments, and the controller builds the outputs' DTensors without running `step`'s
Python at all.
"""
from __future__ import annotations

import collections
import functools
import itertools
import weakref

from .dtensor import compile_capture as capturing
from .dtensor import frontend_state
from .dtensor.autocast import autocast_state
from .errors import CompileError
from .dtensor.recording import Leaf, is_grad_enabled
from .runtime import protocol as wire
from .runtime.controller import session
from .dtensor.tensor import DTensor, new_symbol

__all__ = ["compile", "CompiledFunction"]

DEFAULT_MAX_GRAPHS = 8
_GRAPH_IDS = itertools.count(1)


def compile(fn=None, *, max_graphs: int = DEFAULT_MAX_GRAPHS):
    """`dtorch.compile(fn)` or `@dtorch.compile` / `@dtorch.compile(max_graphs=...)`.
    max_graphs: how many signatures stay captured; the least recently used is dropped (on the
    workers too) when a new one would pass it."""
    if fn is None:
        return lambda f: CompiledFunction(f, max_graphs)
    return CompiledFunction(fn, max_graphs)


class _Graph:
    """What the controller keeps of one capture: enough to replay it without the function."""
    __slots__ = ("graph_id", "controller", "span", "sites", "output_metas", "output_tree", "guards",
                 "after_replay", "step_shifts", "random_count", "random_start", "replays", "rebound_arguments",
                 "state", "state_ids", "grad_inputs", "leaf_hooks", "read_ids", "read_watches", "defined_seq",
                 "generation", "reads_alive", "__weakref__")

    def __init__(self, graph_id, controller, fields: dict, output_metas, output_tree, capture, defined_seq):
        self.graph_id, self.controller, self.defined_seq = graph_id, controller, defined_seq
        self.generation = controller.meshes.generation   # replace_lost_workers: new processes lack the graph
        self.span, self.sites = len(fields["rows"]), fields["sites"]
        self.output_metas, self.output_tree = output_metas, output_tree
        self.guards, self.after_replay = capture.guards, capture.after_replay
        self.step_shifts = fields["step_shifts"]
        self.random_count, self.random_start = fields["random_count"], fields["random_start"]
        self.rebound_arguments = fields["rebound_arguments"]
        self.state = fields["state"]
        self.state_ids = [t._id for t in self.state]   # what each holds after the capture, and every replay
        self.grad_inputs, self.leaf_hooks = fields["grad_inputs"], fields["leaf_hooks"]
        self.replays = 0
        # A tensor fn read from outside its arguments and that has since been released (a name
        # bound to a new tensor, the old one dropped): replaying would read a freed id, so the
        # next call captures again and reads what the name holds now. One that an in-place op
        # gave a new id (p.mul_(0.9) outside) is bound to that id instead (_ReadWatch).
        self.reads_alive = not fields["older_dropped"]
        controller.watch_release(fields["older_reads"], self)
        self.read_ids = [read_id for _, read_id, _ in fields["reads"]]
        self.read_watches = [_ReadWatch(self, slot, ref, key) for slot, (ref, _, key) in enumerate(fields["reads"])]
        for watch, read_id in zip(self.read_watches, self.read_ids):
            controller.watch_release((read_id,), watch)

    def released(self) -> None:
        """A tensor the capture read from outside the arguments is released (Controller.watch_release)."""
        self.reads_alive = False

    def still_valid(self) -> bool:
        controller = self.controller
        return (self.reads_alive and controller is session.controller()
                and controller.meshes.generation == self.generation and all(guard() for guard in self.guards))

    def replay(self, inputs: list):
        controller = self.controller
        seed, first = session.reserve_random(self.random_count)
        shifts = tuple(shift() for shift in self.step_shifts)
        out_ids = controller.new_ids(len(self.output_metas))
        input_ids = (tuple(t._id for t in inputs) + tuple(t._id for t in self.state)
                     + tuple(grad_id(inputs) for grad_id in self.grad_inputs) + tuple(self.read_ids))
        controller.free_before_next()
        seq = controller.submit(wire.RunGraph, self.graph_id, self.span, input_ids, out_ids,
                                seed, first - self.random_start, shifts, self.defined_seq, span=self.span)
        controller.sites.note_replay(seq, self.span, self.sites)
        for hook in self.after_replay:
            hook()
        self.replays += 1
        outputs = [new_symbol(i, meta, seq, controller) for i, meta in zip(out_ids, self.output_metas)]
        for argument, output in self.rebound_arguments:   # changed in place: the caller's tensor takes it
            _take_id(inputs[argument], outputs[output])
        for tensor, final in zip(self.state, self.state_ids):
            if tensor._id != final:   # rebound outside the compiled function since: the replay wrote `final`
                _take_id(tensor, DTensor(final, tensor._meta, seq, None))
        for hook in self.leaf_hooks:
            hook(inputs, outputs)
        return _rebuild(self.output_tree, outputs, inputs)


class _ReadWatch:
    """One tensor from before the call that the capture's ops read (a parameter), watched by the
    id it holds (Controller.watch_release). When that id is released because an in-place op gave
    the tensor a new one, with the same shape, dtype and placements, the replay binds the new id
    in its place; when the tensor itself is gone (or changed layout: `p.data = t`), the next call
    captures again."""
    __slots__ = ("graph", "slot", "tensor", "key", "__weakref__")

    def __init__(self, graph: _Graph, slot: int, tensor, key):
        self.graph, self.slot, self.tensor, self.key = weakref.ref(graph), slot, tensor, key

    def released(self) -> None:
        graph, tensor = self.graph(), self.tensor()
        if graph is None:
            return
        if tensor is None or tensor._id == graph.read_ids[self.slot] or tensor._meta.key != self.key:
            graph.reads_alive = False
            return
        graph.read_ids[self.slot] = tensor._id
        graph.controller.watch_release((tensor._id,), self)


def _take_id(tensor: DTensor, source: DTensor) -> None:
    """`tensor` holds `source`'s id from now on (what an in-place op does, dtorch/dtensor/inplace.py)."""
    old, tensor._id, tensor._seq = tensor._id, source._id, source._seq
    source._controller = None
    tensor._controller.release(old)


class CompiledFunction:
    def __init__(self, fn, max_graphs: int = DEFAULT_MAX_GRAPHS):
        if max_graphs < 1:
            raise ValueError(f"dtorch.compile: max_graphs must be at least 1, got {max_graphs}")
        self.fn, self.max_graphs = fn, max_graphs
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self.captures = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if capturing.active() is not None:   # called inside another capture: part of that one
            return self.fn(*args, **kwargs)
        frontend_state.refuse_inside_checkpoint(f"compiled {self.name}")
        inputs, key = [], []
        _flatten((args, kwargs), inputs, key, {})
        key.append(is_grad_enabled())
        key.append(autocast_state())
        key = tuple(key)
        graph = self._graphs.get(key)
        if graph is not None and graph.still_valid():
            self._graphs.move_to_end(key)
            return graph.replay(inputs)
        return self._capture(key, inputs, args, kwargs)

    def graphs(self) -> int:
        """How many signatures are captured now."""
        return len(self._graphs)

    def _capture(self, key, inputs: list, args, kwargs):
        controller = session.controller()
        input_ids = tuple(t._id for t in inputs)   # before fn: an argument changed in place holds a new id after
        with capturing.Capture(controller, self.name) as capture:
            result = self.fn(*args, **kwargs)
            tree, outputs = _output_tree(result, capture.start_id, inputs, self.name)
            fields = capture.finish(input_ids, tuple(t._id for t in outputs), inputs)
        graph_id = next(_GRAPH_IDS)
        defined_seq = controller.submit(wire.DefineGraph, graph_id, fields["rows"], fields["inputs"], fields["outputs"],
                                        fields["scratch"], fields["random"], fields["steps"])
        self._forget(key)
        metas = ([t._meta for t in outputs] + [inputs[k]._meta for k, _ in fields["rebound_arguments"]]
                 + fields["grad_output_metas"])
        self._graphs[key] = _Graph(graph_id, controller, fields, metas, tree, capture, defined_seq)
        while len(self._graphs) > self.max_graphs:
            self._forget(next(iter(self._graphs)))
        self.captures += 1
        return result

    def _forget(self, key) -> None:
        graph = self._graphs.pop(key, None)
        if graph is not None and not graph.controller.closed:
            graph.controller.submit(wire.DropGraph, graph.graph_id)

    def __repr__(self) -> str:
        return f"dtorch.compile({self.name}, {len(self._graphs)} captured)"


# --- signatures and outputs ------------------------------------------------------------------------
def _flatten(value, tensors: list, key: list, seen: dict) -> None:
    """Append the signature of `value` to `key` and its DTensors to `tensors`, each once (a
    DTensor passed twice keys as the same input: replays bind it once)."""
    if isinstance(value, DTensor):
        if id(value) not in seen:
            seen[id(value)] = len(tensors)
            tensors.append(value)
        key.append(("T", value._meta.key, _grad_state(value), seen[id(value)]))
    elif type(value) in (list, tuple):
        key.append((type(value), len(value)))
        for item in value:
            _flatten(item, tensors, key, seen)
    elif type(value) is dict:
        key.append((dict, tuple(value)))
        for item in value.values():
            _flatten(item, tensors, key, seen)
    elif hasattr(value, "data_ptr"):
        raise CompileError("dtorch.compile: a torch.Tensor argument: upload it with dtorch.tensor(...) before the "
                           "call and pass the DTensor (its values are not part of a signature)")
    else:
        try:
            hash(value)
        except TypeError:
            raise CompileError(f"dtorch.compile: an argument of type {type(value).__name__} is neither a DTensor "
                               "nor hashable, so it cannot be part of a signature; pass DTensors, numbers, "
                               "strings, or tuples, lists and dicts of them") from None
        key.append((type(value), value))


def _grad_state(tensor: DTensor):
    """False, or what a replay's backward builds on: for a leaf, whether it has a grad yet and
    that grad's kind (shape, dtype, placements; bound on the workers), as a guard would check it."""
    node = tensor._node
    if node is None:
        return False
    if type(node) is not Leaf or node.grad is None:
        return True
    return (node.grad._meta.key, node.bound == node.grad._id)


def _output_tree(result, start_id: int, inputs: list, name: str):
    """(tree, the DTensors the call made and returned). Tree leaves: ("out", k), ("in", k) for a
    returned argument, ("const", value) for anything else the call returned."""
    outputs: list = []
    made: dict = {}
    input_index = {id(t): k for k, t in enumerate(inputs)}

    def walk(value):
        if isinstance(value, DTensor):
            if id(value) in input_index:
                return ("in", input_index[id(value)])
            if value._id <= start_id:
                return ("const", value)   # made before the call (a parameter): the same one every time
            if id(value) not in made:
                made[id(value)] = len(outputs)
                outputs.append(value)
            return ("out", made[id(value)])
        if type(value) in (list, tuple):
            return (type(value), [walk(v) for v in value])
        if type(value) is dict:
            return (dict, {k: walk(v) for k, v in value.items()})
        if any(isinstance(v, DTensor) for v in getattr(value, "__dict__", {}).values()):
            raise CompileError(f"compiled {name} returned a {type(value).__name__} holding DTensors: return "
                               "tensors alone or in a tuple, list or dict, so each call gets its own")
        return ("const", value)

    return walk(result), outputs


def _rebuild(tree, outputs: list, inputs: list):
    kind, payload = tree
    if kind == "out":
        return outputs[payload]
    if kind == "in":
        return inputs[payload]
    if kind == "const":
        return payload
    if kind is dict:
        return {k: _rebuild(v, outputs, inputs) for k, v in payload.items()}
    return kind(_rebuild(v, outputs, inputs) for v in payload)
