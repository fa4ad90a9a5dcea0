"""dtorch.compile: capture a function's commands once, replay them with one command per call
(docs/design/compile.md).

    @dtorch.compile
    def step(x, y):
        return (x @ w + y).relu().sum(dim=0)

The first call with a signature (each DTensor argument's shape, dtype, mesh, placements and
requires_grad, and its grad's kind; every other argument's value, but only the type of a number
named in `scalars=`; grad mode; torch.autocast's state) runs `step` as eager code would, and
records the commands it issues (dtorch/dtensor/compile_capture.py). Later calls with that
signature send ONE RunGraph command: the workers run the recorded commands on the new arguments,
and the controller builds the outputs' DTensors without running `step`'s Python at all. What a
replay takes from the moment rather than from the capture travels in that command: the random
stream's position, each optimizer row's step count and hyperparameters (an lr schedule), and the
marked numbers.

Every capture has a reason (`compiled.stats()`): the first call, a new signature (what differs
from the last one), a guard that no longer holds (what changed), or a signature the cache had
dropped. A function that keeps capturing warns once, at the caller's line, with the reason.
"""
from __future__ import annotations

import collections
import functools
import itertools
import re
import warnings
import weakref

from . import compile_signature as signature
from .dtensor import compile_capture as capturing
from .dtensor import frontend_state
from .dtensor.autocast import autocast_state
from .errors import user_frame
from .dtensor.recording import is_grad_enabled
from .runtime import protocol as wire
from .runtime.controller import session
from .dtensor.tensor import DTensor, new_symbol

__all__ = ["compile", "CompiledFunction", "RecaptureWarning"]

DEFAULT_MAX_GRAPHS = 8
# A function warns once when this many of its last RECENT_CALLS calls captured (the first call
# aside): it captures more than it replays, and runs slower than eager.
RECAPTURES_TO_WARN = 4
RECENT_CALLS = 8
_VALUES = re.compile(r" \([^()]* -> [^()]*\)")   # "(0.5 -> 1.5)" in a reason
_GRAPH_IDS = itertools.count(1)


class RecaptureWarning(UserWarning):
    """A compiled function that keeps capturing again, with the reason (once per function)."""


BACKENDS = (None, "replay", "inductor")   # None and "replay": the rows as recorded


def compile(fn=None, *, max_graphs: int = DEFAULT_MAX_GRAPHS, scalars=(), backend=None):
    """`dtorch.compile(fn)` or `@dtorch.compile` / `@dtorch.compile(max_graphs=..., scalars=...)`.
    max_graphs: how many signatures stay captured; the least recently used is dropped (on the
    workers too) when a new one would pass it. scalars: names of `fn`'s parameters whose int or
    float values are inputs of the graph rather than part of the signature (`True`: every int
    and float argument); a replay computes with the call's own value (docs/guide/compile.md).
    backend: None or "replay" runs the recorded rows; "inductor" has each worker compile each
    run of local ops with torch's inductor (docs/guide/compile.md, "Fusing on the workers")."""
    if backend not in BACKENDS:
        raise ValueError(f"dtorch.compile: backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if fn is None:
        return lambda f: CompiledFunction(f, max_graphs, scalars, backend)
    return CompiledFunction(fn, max_graphs, scalars, backend)


class _Graph:
    """What the controller keeps of one capture: enough to replay it without the function."""
    __slots__ = ("graph_id", "controller", "span", "sites", "output_metas", "output_tree", "guards",
                 "after_replay", "step_shifts", "step_hypers", "random_count", "random_start", "replays",
                 "rebound_arguments", "state", "state_ids", "grad_inputs", "leaf_hooks", "read_ids", "read_watches",
                 "defined_seq", "generation", "reads_alive", "dynamic", "kept", "described", "__weakref__")

    def __init__(self, graph_id, controller, fields: dict, output_metas, output_tree, capture, defined_seq):
        self.graph_id, self.controller, self.defined_seq = graph_id, controller, defined_seq
        self.generation = controller.meshes.generation   # replace_lost_workers: new processes lack the graph
        self.span, self.sites = len(fields["rows"]), fields["sites"]
        self.output_metas, self.output_tree = output_metas, output_tree
        self.guards, self.after_replay = capture.guards, capture.after_replay
        self.step_shifts, self.step_hypers = fields["step_shifts"], fields["step_hypers"]
        self.dynamic, self.kept = fields["dynamic"], fields["kept"]   # marked numbers: sent, or held to a value
        self.described: list = []   # the capture's signature in words (compile_signature.described)
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

    def stale(self, numbers: tuple) -> str | None:
        """None while a replay of this capture is right for a call with these marked numbers,
        else why not (the reason the call captures again)."""
        controller = self.controller
        if not self.reads_alive:
            return "a tensor the call reads from outside its arguments was released (its name holds another one)"
        if controller is not session.controller():
            return "a new session (dtorch.init after shutdown)"
        if controller.meshes.generation != self.generation:
            return "workers were replaced (replace_lost_workers)"
        for still_valid, why in self.guards:
            if not still_valid():
                return why() if callable(why) else why
        for k, (value, name, reason) in self.kept.items():
            if numbers[k] != value:
                return f"scalar argument {name} changed ({value!r} -> {numbers[k]!r}); the capture keeps it: {reason}"
        return None

    def replay(self, inputs: list, numbers: tuple):
        controller = self.controller
        seed, first = session.reserve_random(self.random_count)
        # (each part only where the capture has any: a plain function's replay skips them all)
        shifts = tuple([shift() for shift in self.step_shifts]) if self.step_shifts else ()
        hypers = tuple([_changed(*row) if row is not None else {} for row in self.step_hypers]) \
            if self.step_hypers else ()
        out_ids = controller.new_ids(len(self.output_metas))
        input_ids = tuple([t._id for t in inputs])
        if self.state or self.grad_inputs or self.read_ids:
            input_ids += (tuple([t._id for t in self.state]) + tuple([grad_id(inputs) for grad_id in self.grad_inputs])
                          + tuple(self.read_ids))
        controller.free_before_next()
        seq = controller.submit(wire.RunGraph, self.graph_id, self.span, input_ids, out_ids,
                                seed, first - self.random_start, shifts, self.defined_seq,
                                hypers if any(hypers) else (),
                                tuple([numbers[k] for k in self.dynamic]) if self.dynamic else (), span=self.span)
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
        return signature.rebuild(self.output_tree, outputs, inputs, numbers)


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


def _changed(captured: dict, now) -> dict:
    """The hyperparameters of an optimizer row that differ now from the row's (its guard holds
    the rest: flags and buffers)."""
    current = now()
    return {k: v for k, v in current.items() if captured.get(k) != v}


def _take_id(tensor: DTensor, source: DTensor) -> None:
    """`tensor` holds `source`'s id from now on (what an in-place op does, dtorch/dtensor/inplace.py)."""
    old, tensor._id, tensor._seq = tensor._id, source._id, source._seq
    source._controller = None
    tensor._controller.release(old)


class CompiledFunction:
    def __init__(self, fn, max_graphs: int = DEFAULT_MAX_GRAPHS, scalars=(), backend=None):
        if max_graphs < 1:
            raise ValueError(f"dtorch.compile: max_graphs must be at least 1, got {max_graphs}")
        self.fn, self.max_graphs = fn, max_graphs
        self.backend = "" if backend in (None, "replay") else backend   # DefineGraph.backend
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._marks = signature.Marks(fn, scalars, self.name) if scalars else None
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._dropped: collections.OrderedDict = collections.OrderedDict()   # keys max_graphs dropped (bounded)
        self.captures = self.replays = 0
        self._reasons: collections.Counter = collections.Counter()   # why each capture after the first
        self._recent: collections.deque = collections.deque(maxlen=RECENT_CALLS)   # True: a call that recaptured
        self._warned = False
        self._last_reason: str | None = None
        self._kept_scalars: dict = {}   # the last capture's marked numbers it keeps, and why
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if capturing.active() is not None:   # called inside another capture: part of that one
            return self.fn(*args, **kwargs)
        frontend_state.refuse_inside_checkpoint(f"compiled {self.name}")
        numbers, places, keyed = (), (), (args, kwargs)
        if self._marks is not None:
            keyed, numbers, places = self._marks.take(args, kwargs)
        inputs, key = [], []
        signature.flatten(keyed, inputs, key, {})
        key.append(is_grad_enabled())
        key.append(autocast_state())
        key = tuple(key)
        graph = self._graphs.get(key)
        if graph is not None:
            reason = graph.stale(numbers)
            if reason is None:
                self._graphs.move_to_end(key)
                self.replays += 1
                self._recent.append(False)
                return graph.replay(inputs, numbers)
            churn = True
        else:
            reason, churn = self._new_signature(key, keyed)
        return self._capture(key, keyed, inputs, args, kwargs, numbers, places, reason, churn)

    def graphs(self) -> int:
        """How many signatures are captured now."""
        return len(self._graphs)

    def stats(self) -> dict:
        """captures and replays so far, graphs held now, recaptures: {reason: how many captures
        it caused} (every capture after the first; the values a reason names are in
        last_recapture only), last_recapture: the latest reason in full, and kept_scalars:
        {marked argument: why the last capture keeps its value} (empty when every marked number
        is an input)."""
        return {"captures": self.captures, "replays": self.replays, "graphs": len(self._graphs),
                "recaptures": dict(self._reasons), "last_recapture": self._last_reason,
                "kept_scalars": dict(self._kept_scalars)}

    def _new_signature(self, key, keyed) -> tuple[str | None, bool]:
        """(why a call with no capture of its signature captures, whether that counts as churn):
        None for the first call; a signature the cache dropped, or one that differs in a value
        rather than a tensor's layout, counts; a new layout while the cache has room does not."""
        if key in self._dropped:
            return f"its signature's capture had been dropped (max_graphs={self.max_graphs})", True
        if not self._graphs:
            return (None, False) if not self.captures else ("a new signature", False)
        last = next(reversed(self._graphs.values()))
        changes = signature.differences(last.described, signature.described(self.fn, *keyed))
        layouts_only = all(text.startswith("DTensor") for _, _, text in changes)
        said = "; ".join(f"{label} ({old} -> {new})" for label, old, new in changes[:3])
        churn = not layouts_only or len(self._graphs) >= self.max_graphs
        return f"a new signature: {said or 'grad mode or autocast'}", churn

    def _capture(self, key, keyed, inputs: list, args, kwargs, numbers: tuple, places: tuple, reason, churn: bool):
        controller = session.controller()
        input_ids = tuple([t._id for t in inputs])   # before fn: an argument changed in place holds a new id after
        markers = []
        if places and self._marks is not None:
            args, kwargs, markers = self._marks.traced(args, kwargs, places)
        with capturing.Capture(controller, self.name) as capture:
            result = self.fn(*args, **kwargs)
            tree, outputs = signature.output_tree(result, capture.start_id, inputs, self.name, markers)
            fields = capture.finish(input_ids, tuple([t._id for t in outputs]), inputs, markers)
        dynamic = sorted({k for _, _, k in fields["scalars"]})
        slots = tuple([(row, position, dynamic.index(k)) for row, position, k in fields["scalars"]])
        fields["dynamic"] = tuple(dynamic)
        fields["kept"] = {k: (numbers[k], markers[k].name, why) for k, why in fields["kept_scalars"].items()}
        graph_id = next(_GRAPH_IDS)
        defined_seq = controller.submit(wire.DefineGraph, graph_id, fields["rows"], fields["inputs"], fields["outputs"],
                                        fields["scratch"], fields["random"], fields["steps"], slots,
                                        self.backend)
        self._forget(key)
        self._dropped.pop(key, None)
        metas = ([t._meta for t in outputs] + [inputs[k]._meta for k, _ in fields["rebound_arguments"]]
                 + fields["grad_output_metas"])
        graph = self._graphs[key] = _Graph(graph_id, controller, fields, metas, tree, capture, defined_seq)
        graph.described = signature.described(self.fn, *keyed)
        while len(self._graphs) > self.max_graphs:
            self._forget(next(iter(self._graphs)), dropped=True)
        self._kept_scalars = {markers[k].name: why for k, why in fields["kept_scalars"].items()}
        self._counted(reason, churn)
        return signature.rebuild(tree, outputs, inputs, numbers) if markers else result

    def _counted(self, reason: str | None, churn: bool) -> None:
        """Count a capture and its reason; warn once if the function keeps capturing."""
        self.captures += 1
        self._recent.append(churn)
        if reason is None:
            return
        self._reasons[_VALUES.sub("", reason)] += 1   # counted without the values: one row per cause
        self._last_reason = reason
        recaptured = sum(self._recent)
        if churn and recaptured >= RECAPTURES_TO_WARN and not self._warned:
            self._warned = True
            where = user_frame() or ("<unknown>", 0)
            warnings.warn_explicit(
                f"dtorch.compile: {self.name} captured again on {recaptured} of its last {len(self._recent)} calls, "
                f"so it runs slower than uncompiled; the last time because {reason}. {_hint(reason)} "
                f"(compiled.stats() counts every reason)", RecaptureWarning, where[0], where[1])

    def _forget(self, key, dropped: bool = False) -> None:
        graph = self._graphs.pop(key, None)
        if graph is not None and not graph.controller.closed:
            graph.controller.submit(wire.DropGraph, graph.graph_id)
        if dropped:
            self._dropped[key] = None
            while len(self._dropped) > 4 * self.max_graphs:
                self._dropped.popitem(last=False)

    def __repr__(self) -> str:
        return f"dtorch.compile({self.name}, {len(self._graphs)} captured)"


def _hint(reason: str) -> str:
    if "new signature" in reason and "DTensor" not in reason:
        return ("A number that changes from call to call is part of the signature unless it is named in "
                "dtorch.compile(fn, scalars=(...)).")
    if "scalar argument" in reason:
        return "Pass what Python computes from it as a marked argument of its own."
    if "dropped" in reason:
        return "Raise dtorch.compile(fn, max_graphs=...) above the number of signatures in use."
    return "docs/guide/compile.md, 'When a call captures again', says what each guard needs."
