"""The capture in progress: what dtorch.compile records while the first call with a signature runs
(docs/design/compile.md).

The call runs as any eager call does: every command it issues goes to the workers at once. The
controller also hands each one to the capture (`check` before it is numbered, `record` after),
which keeps them with the user's line. When the call returns, `finish` sorts the tensor ids the
call touched:
- inputs: the call's DTensor arguments; a replay binds them to its own arguments;
- outputs: ids the call made and returned; a replay moves them to fresh ids;
- scratch: ids the call made and dropped; a replay frees them;
- persistent: ids the call made and left alive elsewhere (a gradient, an optimizer's state): a
  replay writes them in place, as the call did.

The Python state a replay skips is restored by hooks its owners register while the call runs:
autograd rebinds each leaf's .grad (an argument's to one more output, see _plan_leaves); an
optimizer advances its step counts. Guards say when that state no longer matches what the
capture saw (a fresh optimizer's state now exists, a grad was assigned); the call is then
captured again.

Two kinds of tensor from before the call are bound at each replay to the id they hold then, as
arguments are: a gradient the call built on and replaced (a data-parallel backward reduces into
a new tensor), and a tensor the call read (a parameter) that an in-place op outside has since
given a new id (`p.mul_(0.9)` under no_grad).
"""
from __future__ import annotations

import gc
import threading
import weakref
from typing import NamedTuple, Protocol
from collections.abc import Callable

from ..errors import CompileError, format_site
from ..runtime import protocol as wire
from ..runtime.controller import session
from .compile_scalars import find_slots

__all__ = ["Capture", "CaptureHooks", "active", "RANDOM_FACTORIES", "RANDOM_OPS"]

RANDOM_FACTORIES = ("rand", "randn", "randint")   # Factory args: (seed, counter, ...)
RANDOM_OPS = ("dropout",)   # RunOp: seed and counter as kwargs, or as the last two positional args
# Commands a replay could not repeat: they read files or change the session itself. An Upload
# is kept only when what it made outlives the call (a constant made on first use, as Llama's rope
# tables): replays use that tensor; an upload of per-call data is refused when the call returns.
_REFUSED = (wire.LoadShard, wire.LoadChunks, wire.SaveShard, wire.Profile, wire.Regroup,
            wire.Shutdown, wire.DefineGraph, wire.RunGraph, wire.DropGraph)
_NOT_REPLAYED = (wire.DefineMesh,)   # a mesh is defined once, for good


class CaptureHooks(Protocol):
    """Everything the rest of dtorch tells a capture in progress: the one interface between
    dtorch.compile and the layers that feed it (tests/test_api_table.py holds every call site
    outside this module and compile.py to these names). A module reaches the capture through
    `active()` (or the controller's `capture`, for the two calls made under its lock) and calls
    only these; a new kind of Python state a replay must restore is a new hook here, documented
    with its caller, not a method called ad hoc.

    Callers: the controller (check, record); dtensor/op_issue.py (note_inputs, also through
    note_capture_inputs for dtensor/tensor.py's redistribute and nn/fsdp.py's gather);
    dtensor/inplace.py (rebind); autograd/engine.py (touch_leaf); nn/module.py (note_module);
    optim/optimizer.py (guard, optimizer_step). autograd/retained.py only asks `active()`."""

    def check(self, command_type, site, read, private) -> None:
        """Before the controller numbers a command: refuse what a replay could not repeat."""

    def record(self, command, site) -> None:
        """After the controller numbered a command (under its lock): keep it with its line."""

    def touch_leaf(self, leaf, resets: bool = False) -> None:
        """Autograd is about to change `leaf.grad` (to None when `resets`)."""

    def rebind(self, tensor, old_id: int) -> None:
        """An in-place op gave `tensor` a new id."""

    def note_inputs(self, tensors) -> None:
        """DTensors an op or a redistribute of the call reads."""

    def note_module(self, module) -> None:
        """A module the call ran: its plain settings guard the replay."""

    def guard(self, still_valid: Callable[[], bool], why: str | Callable[[], str]) -> None:
        """A check run before each replay: False captures the call again, for the reason `why`
        (or `why()`, worked out only then) that compiled.stats() reports."""

    def optimizer_step(self, seq: int, shift: Callable[[], int], hyper: Callable[[], dict]) -> None:
        """OptimizerStep `seq` carries step counts and hyperparameters: `shift()` gives how far the
        counts moved, `hyper()` the group's hyperparameters now (a replay sends those that differ
        from the row's: an lr scheduler's lr, OneCycleLR's betas)."""


def active() -> CaptureHooks | None:
    """The capture the current thread runs under, else None (hooks call it: a cheap check)."""
    capture = _current.capture
    return capture if capture is not None and capture.thread == threading.get_ident() else None


class _Current:
    capture = None


_current = _Current()


class Capture(CaptureHooks):
    """The capture of one compiled call: CaptureHooks while the call runs, then `finish`."""

    def __init__(self, controller, name: str):
        self.controller, self.name = controller, name
        self.thread = threading.get_ident()
        self.commands: list = []
        self.sites: list = []
        self.start_id = controller.new_id()   # every id the call makes is above it
        self.seed, self.random_start = session.reserve_random(0)
        self.guards: list = []                # (callable: True while the capture still applies, why not)
        self.after_replay: list = []          # callables: the Python state a replay must set
        self.step_shifts: dict = {}           # OptimizerStep seq -> callable giving its step shift
        self.step_hypers: dict = {}           # OptimizerStep seq -> callable giving its hyperparameters now
        self._leaves: dict = {}               # id(leaf) -> (leaf, its .grad before the call touched it, _Held)
        self._rebound: dict = {}              # id(tensor) -> (tensor, the id it held before the call rebound it)
        self._older_inputs: dict = {}         # id(tensor) -> (weak ref, whether it required grad, its id) when read
        self._modules: dict = {}              # id(module) -> module, for note_module

    # --- while the call runs ---------------------------------------------------------------------
    def __enter__(self) -> Capture:
        if _current.capture is not None or self.controller.tap is not None:
            raise CompileError(f"{self.name}: another capture is in progress (one thread captures at a time)")
        _current.capture = self.controller.tap = self
        return self

    def __exit__(self, *exc) -> None:
        _current.capture = self.controller.tap = None

    def check(self, command_type, site, read, private) -> None:
        """Before the controller numbers a command: refuse what a replay could not repeat."""
        if threading.get_ident() != self.thread:
            return
        where = f"at {format_site(site)}, inside compiled {self.name}"
        if command_type is wire.Profile:   # (it waits for a reply too: not a read of a value)
            raise CompileError(f"dtorch.profile started or stopped {where}: a replay cannot repeat it. Profile "
                               "around the compiled call instead: a replay shows as one RunGraph span holding its rows")
        if read is not None:
            raise CompileError(f"a read ({command_type.__name__}: .item(), to_torch(), fetch(), bool() or Python "
                               f"control flow on a tensor value) {where}: a compiled function runs on the workers "
                               "without coming back to Python, so it cannot look at values. Return the tensor "
                               "and read it after the call, or leave this function uncompiled")
        if command_type in _REFUSED or (private is not None and command_type is not wire.Upload):
            raise CompileError(f"{command_type.__name__} {where}: a replay cannot repeat it")

    def record(self, command, site) -> None:
        """Under the controller's lock, after numbering. Frees come from any thread (a dropped
        DTensor); every other command only from the capturing thread."""
        if type(command) is wire.Free or (threading.get_ident() == self.thread
                                          and type(command) not in _NOT_REPLAYED):
            self.commands.append(command)
            self.sites.append(format_site(site) if site is not None else "<freed>")

    # --- hooks for the layers above ----------------------------------------------------------------
    def touch_leaf(self, leaf, resets: bool = False) -> None:
        """Autograd is about to change `leaf.grad`. `resets`: to None (zero_grad), which no
        command depends on the old value of."""
        if id(leaf) not in self._leaves:
            before = None if resets else leaf.grad
            held = None if before is None else _Held(before._id, before._meta.key, leaf.bound == before._id)
            self._leaves[id(leaf)] = (leaf, before, resets, held)

    def rebind(self, tensor, old_id: int) -> None:
        """An in-place op gave `tensor` a new id (dtorch/dtensor/inplace.py)."""
        if id(tensor) not in self._rebound:
            self._rebound[id(tensor)] = (tensor, old_id)

    def note_inputs(self, tensors) -> None:
        """DTensors an op or a redistribute of the call reads. Whether one made before the call
        (a parameter) requires grad decided what autograd recorded and which leaves the backward
        fills, so a replay holds only while that is unchanged: a layer frozen or unfrozen
        between calls captures again (a replay ignored the one and failed on the other)."""
        start, seen = self.start_id, self._older_inputs
        for tensor in tensors:
            if tensor._id < start and id(tensor) not in seen:
                seen[id(tensor)] = (weakref.ref(tensor), tensor.requires_grad, tensor._id)

    def note_module(self, module) -> None:
        """A module the call ran: its plain settings (training, momentum, eps, p...) shaped what
        the capture recorded, as Python values do; a replay holds while they are unchanged
        (model.eval() between calls captures again, as torch.compile's guards would)."""
        if id(module) not in self._modules:
            settings = _settings(module)
            self._modules[id(module)] = module
            self.guards.append((lambda: _settings(module) == settings, lambda: _settings_changed(module, settings)))

    def guard(self, still_valid, why) -> None:
        self.guards.append((still_valid, why))

    def optimizer_step(self, seq: int, shift, hyper) -> None:
        """OptimizerStep `seq` carries step counts and hyperparameters; `shift()` (run once per
        replay) gives how far the counts moved since the capture, and advances the optimizer's
        own count; `hyper()` gives the group's hyperparameters now."""
        self.step_shifts[seq] = shift
        self.step_hypers[seq] = hyper

    # --- when the call has returned ---------------------------------------------------------------
    def finish(self, input_ids: tuple, output_ids: tuple, arguments: list = (), markers: list = ()) -> dict:
        """The DefineGraph fields and what the controller keeps for replays. `arguments`: the
        call's DTensor arguments, in input order; `markers`: its numbers that are inputs of the
        graph, as the call saw them (compile_scalars.py).

        A tensor the call changed in place holds a new id now. An argument's new id is one more
        output: each replay gives the caller's tensor the replay's own. A tensor from before the
        call (a parameter changed in place) becomes one more input, bound at each replay to the
        id it holds then; the replay writes its new id in place, as the call did. Then come the
        gradients the call replaced (_plan_leaves) and the tensors it read (_carried_reads)."""
        end_id = self.controller.new_id()
        made = range(self.start_id + 1, end_id)
        if self._undecided(made, output_ids):
            # Symbols in reference cycles go now, so their ids count as dropped. A full
            # collection costs ~0.3 s in a process of 500k objects: only when it can matter.
            gc.collect()
        rebound_arguments, state = [], []
        for tensor, old_id in self._rebound.values():
            if tensor._id not in made:
                continue
            if old_id in input_ids:
                rebound_arguments.append((input_ids.index(old_id), len(output_ids)))
                output_ids += (tensor._id,)
            elif old_id not in made:
                state.append(tensor)
                input_ids += (old_id,)
        leaves = self._plan_leaves(made, arguments, input_ids, output_ids)
        input_ids, output_ids = leaves["inputs"], leaves["outputs"]
        dropped = self._dropped()
        scratch = tuple(sorted(i for i in dropped if i in made and i not in output_ids))
        self._refuse_per_call_uploads(set(scratch) | set(output_ids))
        rows, sites = self._rows(made)
        older_reads = _older_reads(rows, self.start_id, set(input_ids))
        reads = self._carried_reads(older_reads)
        input_ids += tuple([read_id for _, read_id, _ in reads])
        self.guards.extend(_same_requires_grad(ref, flag) for ref, flag, _ in self._older_inputs.values())
        steps = [c for c in rows if type(c) is wire.OptimizerStep]
        _, random_end = session.reserve_random(0)
        slots, kept = find_slots(rows, list(markers))
        return {
            "rows": tuple([wire.command_row(c) for c in rows]),
            "sites": sites,
            "inputs": input_ids,
            "outputs": output_ids,
            "scratch": scratch,
            "random": tuple([i for i, c in enumerate(rows)
                            if _draws_random(c, self.seed, range(self.random_start, random_end))]),
            "steps": tuple([i for i, c in enumerate(rows) if type(c) is wire.OptimizerStep]),
            "scalars": slots,                         # (row, argument index, marker index): a replay's number there
            "kept_scalars": kept,                     # marker index -> why the graph keeps the captured value
            "step_shifts": [self.step_shifts.get(c.seq, _no_shift) for c in steps],
            # per OptimizerStep row: (its hyperparameters, a callable giving them now), or None
            "step_hypers": [(c.hyper, self.step_hypers[c.seq]) if c.seq in self.step_hypers else None for c in steps],
            "rebound_arguments": rebound_arguments,   # (argument index, output index)
            "state": state,                           # tensors bound to the inputs after the arguments
            "grad_inputs": leaves["grad_inputs"],     # then: (inputs) -> the id of a gradient to bind
            "reads": reads,                           # then: (weak ref, id, meta key) of each tensor read
            "leaf_hooks": leaves["hooks"],            # (inputs, outputs) -> None: each leaf's .grad set
            "grad_output_metas": leaves["metas"],     # outputs after the rebound arguments: arguments' grads
            "random_count": random_end - self.random_start,
            "random_start": self.random_start,
            # read by id only (Controller.watch_release); not one dropped during the call: its release
            # is past, and a watch on it would stay forever, one per capture (issue 43)
            "older_reads": older_reads - dropped - {read_id for _, read_id, _ in reads},
            # one already dropped during the call (a module attribute bound to a new tensor): a
            # replay would read a freed id, so the next call captures again
            "older_dropped": bool(older_reads & dropped),
        }

    def _dropped(self) -> set:
        """Ids freed during the call, or dropped and not yet in a Free."""
        dropped = {i for c in self.commands if type(c) is wire.Free for i in c.ids}
        dropped.update(self.controller.released_pending())
        return dropped

    def _undecided(self, made: range, output_ids: tuple) -> list:
        """Ids the call made that are not returned, not a rebound tensor's and not dropped:
        persistent state (a gradient, an optimizer's), or garbage that only the cycle collector
        can free. Most calls leave none."""
        settled = self._dropped() | set(output_ids) | {t._id for t, _ in self._rebound.values()}
        return [i for i in made if i not in settled]

    def _refuse_per_call_uploads(self, per_call: set) -> None:
        for command, site in zip(self.commands, self.sites):
            if type(command) is wire.Upload and command.out_id in per_call:
                raise CompileError(f"an upload (dtorch.tensor, or a torch tensor passed to an op) at {site}, inside "
                                   f"compiled {self.name}, makes a tensor for this call only: a replay cannot send "
                                   "new data. Upload it before the call and pass the DTensor as an argument")

    def _rows(self, made: range) -> tuple[list, list]:
        """The recorded commands, Frees cut to the ids the call made (older ones were freed for
        good), Uploads left out (what they made stays: _refuse_per_call_uploads)."""
        rows, sites = [], []
        for command, site in zip(self.commands, self.sites):
            if type(command) is wire.Upload:
                continue
            if type(command) is wire.Free:
                ids = tuple([i for i in command.ids if i in made])
                if not ids:
                    continue
                command = command._replace(ids=ids)
            rows.append(command)
            sites.append(site)
        return rows, sites

    def _plan_leaves(self, made: range, arguments, input_ids: tuple, output_ids: tuple) -> dict:
        """How a replay sets each touched leaf's .grad as the call left it. The leaf is the
        captured one (a parameter), or, for an argument's, the replay's argument at that index:
        its grad is one more output, fresh per replay, as eager gives each call's input its own.
        A gradient from before the call that the call built on and then replaced (a
        data-parallel backward reduces into a new tensor; zero_grad(set_to_none=False) keeps
        one) is one more input, bound at each replay to the grad the leaf holds then; a
        parameter's is guarded to be like the captured one (placements, bound on the workers),
        an argument's is part of the signature (compile._grad_state)."""
        argument_of = {id(t._node): k for k, t in enumerate(arguments) if t._node is not None}
        grad_inputs, hooks, metas = [], [], []
        for leaf, before, resets, held in self._leaves.values():
            k = argument_of.get(id(leaf))
            current = (lambda inputs, leaf=leaf: leaf) if k is None else (lambda inputs, k=k: inputs[k]._node)
            after, bound = leaf.grad, leaf.bound
            carried = (held is not None and held.id < self.start_id and held.id not in input_ids
                       and (k is not None or after is not before))
            if carried:
                input_ids += (held.id,)
                grad_inputs.append(lambda inputs, current=current: current(inputs).grad._id)
                if k is None:
                    self.guards.append((lambda leaf=leaf, held=held: _grad_like(leaf, held),
                                        lambda leaf=leaf: f"{_leaf_name(leaf)}'s .grad is not of the kind the capture "
                                                          "built on (None, or another shape, dtype or placements)"))
            elif k is None and not resets:   # the commands build on this very gradient (or on none)
                self.guards.append((lambda leaf=leaf, before=before: leaf.grad is before,
                                    lambda leaf=leaf, before=before: f"{_leaf_name(leaf)}'s .grad is "
                                    f"{'a tensor' if leaf.grad is not None else 'None'}, the capture built on "
                                    f"{'a tensor it accumulated into' if before is not None else 'None'}"))
            if k is not None and after is before and after is not None:
                continue   # accumulated in place: the argument's own grad holds the sum
            if after is not None and after._id in made and (k is not None or after._id in output_ids):
                if after._id not in output_ids:
                    output_ids += (after._id,)
                    metas.append(after._meta)
                hooks.append(_rebind_grad(current, output_ids.index(after._id), bound == after._id))
            else:   # None, or a tensor every replay writes in place (persistent) or from before the call
                hooks.append(_restore_grad(current, after, bound if k is None else None))
        return {"inputs": input_ids, "outputs": output_ids, "grad_inputs": grad_inputs, "hooks": hooks,
                "metas": metas}

    def _carried_reads(self, older_reads: set) -> list:
        """(weak ref, id, meta key) of each tensor from before the call that the ops read and that
        still holds that id: a replay binds the id to the one it holds then, which an in-place
        op outside gives it (compile._ReadWatch). Ids read with no live tensor stay as they are."""
        reads, seen = [], set()
        for ref, _, read_id in self._older_inputs.values():
            tensor = ref()
            if read_id in older_reads and read_id not in seen and tensor is not None and tensor._id == read_id:
                seen.add(read_id)
                reads.append((ref, read_id, tensor._meta.key))
        return reads


class _Held(NamedTuple):
    """A leaf's .grad when the call first touched it."""
    id: int
    key: tuple          # its TensorMeta key (shape, dtype, mesh, placements)
    bound: bool         # whether the workers' .grad held it (Leaf.bound)


def _grad_like(leaf, held: _Held) -> bool:
    grad = leaf.grad
    return grad is not None and grad._meta.key == held.key and (leaf.bound == grad._id) == held.bound


def _rebind_grad(current, output: int, bound: bool):
    def hook(inputs, outputs) -> None:
        node, grad = current(inputs), outputs[output]
        node.grad, node.bound = grad, grad._id if bound else None   # None: the next backward binds it first
    return hook


def _restore_grad(current, grad, bound):
    def hook(inputs, outputs) -> None:
        node = current(inputs)
        node.grad, node.bound = grad, bound if grad is not None else None
    return hook


def _draws_random(command, seed: int, counters: range) -> bool:
    """Whether `command` took its (seed, counter) from the global stream during the capture (a
    caller may also pass dropout an explicit seed and counter: those stay as they are)."""
    if type(command) is wire.Factory and command.kind in RANDOM_FACTORIES:
        drawn = command.args[:2]
    elif type(command) is wire.RunOp and command.op in RANDOM_OPS:
        kwargs = command.kwargs
        drawn = (kwargs["seed"], kwargs["counter"]) if "counter" in kwargs else command.args[-2:]
    else:
        return False
    return len(drawn) == 2 and drawn[0] == seed and drawn[1] in counters


_PLAIN = (bool, int, float, str, type(None))


def _settings(module) -> tuple:
    """A module's public attributes that are plain values (not tensors, submodules or hooks).
    Private ones are its own bookkeeping (BatchNorm2d's batch count changes every call)."""
    return tuple([(name, value) for name, value in module.__dict__.items()
                 if type(value) in _PLAIN and not name.startswith("_")])


def _settings_changed(module, settings: tuple) -> str:
    now = dict(_settings(module))
    changed = [f"{name} ({value!r} -> {now.get(name, '(deleted)')!r})" for name, value in settings
               if now.get(name, _MISSING) != value]
    added = [f"{name} = {value!r}" for name, value in now.items() if name not in dict(settings)]
    return f"{type(module).__name__}'s settings changed: {', '.join(changed + added)}"


_MISSING = object()


def _same_requires_grad(ref, flag: bool):
    # a tensor since released fails Graph.reads_alive instead, where the capture read it by id
    def why() -> str:
        tensor = ref()
        what = "a tensor" if tensor is None else f"a tensor ({tensor._meta.describe()})"
        change = "frozen" if flag else "unfrozen"
        return f"{what} the call reads from outside its arguments was {change} (requires_grad)"
    return (lambda: (ref() is None) or ref().requires_grad == flag), why


def _leaf_name(leaf) -> str:
    tensor = leaf.tensor()
    return "a parameter" if tensor is None else f"a parameter ({tensor._meta.describe()})"


def _no_shift() -> int:
    return 0


def _older_reads(rows: list, start_id: int, inputs: set) -> set:
    """Ids that ops of the call read and that were made before it, not passed in: tensors the
    function reads from a closure, a global or a module attribute (its parameters). A replay
    reads them by these ids, so the graph is stale once one is released (compile._Graph)."""
    found = set()

    def walk(value) -> None:
        if type(value) is wire.WireRef:
            if value.id < start_id and value.id not in inputs:
                found.add(value.id)
        elif type(value) in (tuple, list):
            for item in value:
                walk(item)
        elif type(value) is dict:
            for item in value.values():
                walk(item)
    for command in rows:
        if type(command) is wire.RunOp:
            walk(command.args)
            walk(command.kwargs)
    return found
