"""dtorch.compile(fn, backend="inductor"): each run of plain rows (straight_line.py) compiled by
torch's inductor on the worker, so a run of local ops is one fused kernel instead of one torch
call per op (docs/design/compile.md, "Fusing on the workers").

A FusedRun stands where its StraightLine stood in a graph's plan and answers the same `run`. It
hands the run's pure form (`fused(t3, t7) -> (t9, t12)`) to `torch.compile(backend="inductor",
dynamic=False, fullgraph=True)`; the first replay compiles it (a graph's shapes are fixed, so
once), through inductor's on-disk cache, which every rank of a host shares.

Anything that goes wrong in the fused function runs the StraightLine from the same inputs, which
are untouched (workers never write a buffer in place: docs/reference/inplace.md):
- if the rows succeed, inductor is at fault: the run keeps the StraightLine from then on, and
  the worker warns once with the reason (a RuntimeWarning that the controller shows at the
  user's line, as it shows any warning a command raised: WarningReport);
- if a row fails, the StraightLine reports it as a replay does (the op, its seq, the user's
  line). A run whose compiled function had worked before keeps it (a bad index this call);
  one that never compiled keeps the StraightLine.

A training forward's run (rows recorded for backward) fuses too: its pure form calls each kernel
with grad mode on, so torch.compile's AOTAutograd makes the run one autograd node whose backward
is compiled as well. What the rows do besides, the fused run does as a whole:
- fsdp's saved-tensor hooks: where an input is a gathered parameter, the compiled function's
  saved tensors that share its storage are saved as the way to gather it again
  (kernels.saving_gathered_storages), so backward gathers it again as the rows' would;
- the joins of backward.run_recorded (an output that does not depend on its inputs on this
  rank, joined to them so every rank's graph reaches the same collectives): the fused function
  has none, so the run's first call runs the rows and then probes the fused function on the same
  inputs, and keeps it only if every output it stores records as the rows' does (_probe);
- a row that saves gathered parameters whole (RunOp.regather False) gives no pure form at all.

Runs that are not fused: those, and a run on CPU where no C++ compiler is found (inductor's CPU
code is C++).

After the first call, a run calls inductor's compiled function itself, past dynamo's frame hook
and guards (about 11 us a call on CPU, where the chain's whole kernel is 10-25 us): the graph's
shapes are fixed by its signature, and what else dynamo would guard is checked here per call, in
a list compare (each input's dtype and requires_grad), while inductor's own code asserts each
input's size and stride. It is only done where dynamo's graph is the pure function exactly (each
loaded tensor a placeholder, in order; each stored one a distinct output, in order) and a second
call of inductor's function gave the first call's outputs bit for bit (_Inductor, _past_dynamo).
Inputs that differ, or a failing call, go back to torch.compile's call, guards and all.
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch

from . import cuda_graphs, graphs
from .kernels import saves_gathered, saving_gathered_storages
from .straight_line import StraightLine

__all__ = ["FusedRun", "fuse", "foreach_updates"]

# AOTAutograd's own on-disk cache (beside inductor's FX graph cache, which holds the compiled
# kernels and stays on) pickled a training run's entry into a segfault in torch 2.13: a worker
# lost at its first backward, in benchmark 10's tp2 fused row after the unfused tp2 row had run
# on the same workers (reproduced twice; gone with this cache off). Off unless the user chose.
if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ:
    import torch._functorch.config
    torch._functorch.config.enable_autograd_cache = False


def fuse(plan: tuple | None) -> tuple | None:
    """The plan with each fusable StraightLine as a FusedRun."""
    if plan is None:
        return None
    return tuple([FusedRun(step) if type(step) is StraightLine and step.pure_source is not None else step
                  for step in plan])


def foreach_updates(graph):
    """The graph with each optimizer row that left torch's implementation to its default (foreach
    None) on torch's foreach kernels: one kernel per op over all of a group's shards rather than
    a loop of calls per tensor, the same numbers (runtime/worker/optim_kernels.py; NAdam's and
    RAdam's within rounding). The user's own foreach= or fused= stands."""
    steps = [(i, graph.commands[i]) for i in graph.steps]
    return graphs.with_commands(graph, {i: step._replace(hyper={**step.hyper, "foreach": True}) for i, step in steps
                                        if step.hyper.get("foreach", False) is None and not step.hyper.get("fused")})


class FusedRun:
    """A StraightLine's rows as one inductor-compiled function (see the module's doc)."""

    def __init__(self, straight: StraightLine):
        self.straight, self.rows = straight, straight.rows
        self.hoisted, self.deferred = straight.hoisted, straight.deferred   # (graphs._run_plan reads them)
        self.pure = straight.pure_function()
        self.inductor = _Inductor()
        self.compiled = torch.compile(self.pure, backend=self.inductor, dynamic=False, fullgraph=True)
        self.unguarded = None      # inductor's function past dynamo, once checked (_past_dynamo)
        self.input_kinds = None    # what the unguarded call checks per call: each input's dtype and requires_grad
        self.replay_only = False   # set once the fused function failed: the StraightLine runs
        self.compiling = True      # until the first call, which compiles, has succeeded
        self.records = straight.records   # a training forward's run: AOTAutograd compiles its backward too
        self.probing = straight.records   # its first call runs the rows, then checks the fused function's outputs

    def forget(self) -> None:
        self.straight.forget()

    def run(self, tensors: dict):
        """As StraightLine.run: None when every row ran, else (row, error, what the rows made)."""
        if self.replay_only:
            return self.straight.run(tensors)
        try:
            inputs = [tensors[i] for i in self.straight.loads]
        except KeyError:   # missing or poisoned: the StraightLine says which
            return self.straight.run(tensors)
        if self.probing:
            return self._probe(tensors, inputs)
        try:
            outputs = self._compile_and_run(inputs) if self.compiling else self._call(inputs)
        except _NoCompiler as missing:
            return self._fall_back(tensors, str(missing))
        except Exception as error:  # noqa: BLE001 -- inductor's or a row's: the StraightLine tells which
            return self._fall_back(tensors, f"{type(error).__name__}: {_first_line(error)}")
        tensors.update(zip(self.straight.stores, outputs))
        return None

    def _call(self, inputs: list):
        """The fused function. A training run's records as its rows do: with fsdp's saved-tensor
        hooks where an input is a gathered parameter (so backward gathers it again), grad mode
        back as it was even if it raised midway. It is called with grad mode on (its first line
        turns it off, as the worker runs): AOTAutograd rebuilds an output that is a view of
        another (a reshape's) outside the compiled function, in the caller's mode, and with it
        off that view would not require grad."""
        if not self.records:
            return self._invoke(inputs)
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        try:
            if saves_gathered(inputs):
                with saving_gathered_storages(inputs):
                    return self._invoke(inputs)
            return self._invoke(inputs)
        finally:
            torch._C._set_grad_enabled(grad_mode)

    def _invoke(self, inputs: list):
        """inductor's function past dynamo where the inputs are of the kinds it was compiled for,
        else torch.compile's call. Where the unguarded call raises and the guarded one then works
        (an input of another size or stride, which inductor's code asserts, and dynamo
        recompiles for), the run leaves its guards to dynamo from then on; where both raise, the
        inputs were bad (an index out of range), and the run reports it as before."""
        if self.unguarded is None or _kinds(inputs) != self.input_kinds:
            return self.compiled(*inputs)
        try:
            return self.unguarded(*inputs)
        except Exception:  # noqa: BLE001 -- dynamo's call decides: it recompiles, or raises what the run reports
            outputs = self.compiled(*inputs)
            self.unguarded = None
            return outputs

    def _compile_and_run(self, inputs: list):
        """The first call, which compiles; until it succeeds, every call is a first call."""
        missing = _missing_compiler(inputs)
        if missing is not None:
            raise _NoCompiler(missing)
        with warnings.catch_warnings():   # torch's own deprecations while it compiles are not the user's business
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            outputs = self._call(inputs)
        self.compiling = False
        # on a GPU, the compiled function captured into a CUDA graph from the next call (cuda_graphs.py);
        # elsewhere called past dynamo where that is exact
        graphed = cuda_graphs.graphed(self.compiled, inputs, outputs)
        if graphed is self.compiled:
            self._past_dynamo(inputs, outputs)
        self.compiled = graphed
        return outputs

    def _past_dynamo(self, inputs: list, outputs) -> None:
        """Call inductor's function itself from now on, if dynamo's one graph is the pure
        function exactly and a second call of it gives `outputs` (this first call's) again."""
        function = self.inductor.stand_in([f"L_t{i}_" for i in self.straight.loads], len(outputs))
        self.inductor.compiled.clear()   # dynamo's graph is not needed any more; its function dynamo keeps
        if function is None:
            return
        self.unguarded, self.input_kinds = function, _kinds(inputs)
        try:
            again = self._call(inputs)   # (an unguarded call that raises leaves unguarded None: _invoke)
        except Exception:  # noqa: BLE001 -- dynamo's call has just run on these inputs; keep to it
            again = ()
        if len(again) != len(outputs) or not all(map(_identical, again, outputs)):
            self.unguarded = None

    def _probe(self, tensors: dict, inputs: list):
        """A training run's first call: the rows run (their outputs are this call's), then the
        fused function compiles and runs on the same inputs, and is kept only if each output it
        stores records as the rows' does (requires grad or not, dtype, shape). The rows join an
        output that does not depend on their inputs to them (backward.run_recorded); the fused
        function has no such joins, so a run that needs one stays the rows. The probe's outputs,
        and the graph they recorded, are dropped."""
        stopped = self.straight.run(tensors)
        if stopped is not None:   # a row failed, reported as a replay reports it: probe again next call
            return stopped
        try:
            outputs = self._compile_and_run(inputs)
        except _NoCompiler as missing:
            return self._keep_rows(str(missing))
        except Exception as error:  # noqa: BLE001 -- the rows ran on these inputs: the compiler's fault
            return self._keep_rows(f"{type(error).__name__}: {_first_line(error)}")
        self.probing = False
        differs = _recording_differs(self.straight.stores, outputs, tensors)
        return None if differs is None else self._keep_rows(differs)

    def _keep_rows(self, reason: str) -> None:
        """The rows ran, and run from now on; the user learns why, once."""
        self.replay_only, self.probing = True, False
        self._warn(reason)
        return None

    def _warn(self, reason: str) -> None:
        first, last = self.rows.start, self.rows.stop - 1
        warnings.warn(f"dtorch.compile(backend='inductor'): rows {first}-{last} of this graph run as the replay, "
                      f"unfused: {reason}", RuntimeWarning, stacklevel=3)

    def _fall_back(self, tensors: dict, reason: str):
        """Run the rows instead. A compiled function whose rows failed too (a bad index, which
        its bounds check caught) stays: the next inputs may be good."""
        self.replay_only = self.compiling
        stopped = self.straight.run(tensors)
        self.replay_only |= stopped is None
        if stopped is None:   # the rows ran: the fault was the compiler's
            self._warn(reason)
        return stopped


class _Inductor:
    """torch.compile's backend for a FusedRun: inductor's (compile_fx, as backend="inductor"
    calls it), keeping each graph dynamo gave it and the function inductor made of it."""

    def __init__(self):
        self.compiled: list = []   # [(dynamo's GraphModule, inductor's function)]

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        function = compile_fx(graph_module, example_inputs)
        self.compiled.append((graph_module, function))
        return function

    def stand_in(self, placeholders: list, returns: int):
        """inductor's function, if dynamo made one graph whose placeholders are `placeholders`
        (dynamo's names for the pure function's parameters, in order) and whose outputs are
        `returns` distinct values that the graph computes (not an input passed through, not a
        constant: dynamo returns those itself), in the pure function's order; else None."""
        if len(self.compiled) != 1:
            return None
        graph_module, function = self.compiled[0]
        nodes = graph_module.graph.nodes
        if [node.target for node in nodes if node.op == "placeholder"] != placeholders:
            return None
        output = next(node for node in reversed(nodes) if node.op == "output")
        values = output.args[0]
        if type(values) not in (tuple, list) or len(values) != returns or len(set(values)) != returns:
            return None
        if any(type(value) is not torch.fx.Node or value.op == "placeholder" for value in values):
            return None
        return function


def _kinds(inputs: list) -> list:
    """What dynamo guards on that a graph's signature does not fix, per input."""
    return [(tensor.dtype, tensor.requires_grad) for tensor in inputs]


def _identical(mine, theirs) -> bool:
    """The same tensor bit for bit, recorded the same way (NaNs compare unequal: not identical)."""
    return (type(mine) is torch.Tensor and type(theirs) is torch.Tensor and mine.dtype == theirs.dtype
            and mine.shape == theirs.shape and mine.stride() == theirs.stride()
            and mine.requires_grad == theirs.requires_grad and torch.equal(mine, theirs))


class _NoCompiler(Exception):
    """No C++ compiler for a CPU run: the rows replay, and the user learns why."""


def _recording_differs(stores: tuple, fused: tuple, tensors: dict) -> str | None:
    """How the fused function's outputs record differently from the rows' (in the table), or None."""
    for tensor_id, mine in zip(stores, fused):
        theirs = tensors[tensor_id]
        if type(mine) is not torch.Tensor or type(theirs) is not torch.Tensor:
            continue
        if (mine.requires_grad, mine.dtype, mine.shape) != (theirs.requires_grad, theirs.dtype, theirs.shape):
            return (f"t{tensor_id} would be requires_grad={mine.requires_grad} {mine.dtype} {tuple(mine.shape)} "
                    f"fused, requires_grad={theirs.requires_grad} {theirs.dtype} {tuple(theirs.shape)} as the rows "
                    "record it (an output joined to inputs it does not depend on)")
    return None


def _missing_compiler(inputs: list) -> str | None:
    """Why inductor cannot compile for these tensors' device here, or None."""
    if not any(type(t) is torch.Tensor and t.device.type == "cpu" for t in inputs):
        return None
    # imported here, before the run's first compile (it reads CXX once): importing inductor is
    # for workers whose graphs fuse, and it probes optional packages that dtorch does not declare
    from torch._inductor import config as inductor_config
    compiler = os.environ.get("CXX") or inductor_config.cpp.cxx[1] or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX), which inductor needs on CPU"
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
