"""dtorch.compile(fn, backend="inductor") (issue 46 part 1): each worker compiles each run of plain
rows with torch's inductor (runtime/worker/fusion.py). Fused equals eager (float32 within 1e-5
relative; random numbers bit for bit); where inductor cannot compile a run, the run replays and
warns once; a failure inside a fused run names the op and the user's line.

Inductor's first compile of a graph takes seconds on 2 cores; its on-disk cache
(TORCHINDUCTOR_CACHE_DIR, by default one directory per user per host) makes every later process
reuse it, so the graphs here are few and small. test_compile's random chains, fused, run with
DTORCH_FUSION_SWEEP=1 (the "sweep" tests at the end). A training forward's run, in process here
(AOTAutograd, fsdp's saved gathered parameters, the probe); training steps of every parallelism
over 20 steps in a session: tests/test_fused_training.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import dtorch
from dtorch.errors import RemoteError
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices.device import CpuDevice
from dtorch.runtime.worker import fusion
from dtorch.runtime.worker.worker import Worker
from dtorch.spec.placements import Replicate, Shard
from test_replay_rows import Replies, TensorId, deliver, run_op

pytestmark = pytest.mark.timeout(300)

RTOL = 1e-5
TABLE, INPUT, CAPTURED = 1, 2, 100
REPLICATE = (Replicate(),)


def _line_of(pattern: str) -> int:
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if pattern in line and "_line_of" not in line)


def _close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL, msg=what or None)


# --- one worker in process: the plan, the fallback, a failing row ------------------------------------
def _chain_rows() -> tuple:
    """out = ((table.index_select(0, index) @ transposed).sin() * 2).tanh(), as a graph's rows."""
    t, picked, product, sine, scaled, out = TensorId(TABLE), *(TensorId(CAPTURED + i) for i in range(1, 6))
    commands = [run_op(0, picked, "index_select", t, 0, TensorId(CAPTURED)),
                run_op(1, product, "matmul", picked, TensorId(CAPTURED + 6)),
                run_op(2, sine, "sin", product),
                run_op(3, scaled, "mul", sine, 2.0),
                run_op(4, out, "tanh", scaled)]
    return tuple(wire.command_row(c) for c in commands)


def _chain_in_torch(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return ((table.index_select(0, index) @ table.T.contiguous()).sin() * 2.0).tanh()


def _fused_worker(table: torch.Tensor) -> tuple[Worker, Replies]:
    replies = Replies()
    worker = Worker(0, replies, None, CpuDevice(), start_seq=0)
    rows = _chain_rows()
    deliver(worker, lambda s: [
        wire.DefineMesh(s, 0, "cpu", (1,), (0,)),
        wire.Factory(s + 1, TABLE, 0, "zeros", tuple(table.shape), "float32", REPLICATE, ()),
        wire.DefineGraph(s + 2, 7, rows, (CAPTURED, CAPTURED + 6), (CAPTURED + 5,),
                         (CAPTURED + 1, CAPTURED + 2, CAPTURED + 3, CAPTURED + 4), (), (), (), "inductor")])
    worker.tensors[TABLE] = table
    return worker, replies


def _replay(worker: Worker, index: torch.Tensor, transposed: torch.Tensor, out_id: int) -> int:
    worker.tensors[INPUT], worker.tensors[INPUT + 1] = index, transposed
    seq = worker.next_seq
    deliver(worker, lambda s: [wire.RunGraph(s, 7, len(_chain_rows()), (INPUT, INPUT + 1), (out_id,), 0, 0, (), 2)])
    return seq


def _fused_runs(worker: Worker) -> list:
    return [step for step in worker.graph_commands.graphs[7].plan if type(step) is fusion.FusedRun]


def test_a_run_of_plain_rows_is_compiled_by_inductor_and_equals_torch():
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    (run,) = _fused_runs(worker)
    assert (run.rows.start, run.rows.stop) == (0, 5)
    for out_id, index in ((10, torch.tensor([0, 6, 2])), (11, torch.tensor([4, 4, 1]))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # no fallback
            _replay(worker, index, table.T.contiguous(), out_id)
        _close(worker.tensors[out_id], _chain_in_torch(table, index))
    assert not run.replay_only and replies.sent == []
    assert set(worker.tensors) == {TABLE, INPUT, INPUT + 1, 10, 11}   # scratch dropped


def test_without_a_cpp_compiler_a_run_replays_and_warns_once(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-for-dtorch")
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    index = torch.tensor([3, 1])
    with pytest.warns(RuntimeWarning, match=r"rows 0-4 of this graph run as the replay, unfused: no C\+\+ compiler"):
        _replay(worker, index, table.T.contiguous(), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # once
        _replay(worker, index, table.T.contiguous(), 11)
    assert torch.equal(worker.tensors[10], _chain_in_torch(table, index))   # the replay: eager's bits
    assert torch.equal(worker.tensors[11], worker.tensors[10]) and replies.sent == []


def test_a_run_inductor_fails_on_replays_and_warns_with_the_reason():
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    (run,) = _fused_runs(worker)

    def inductor_fails(*tensors):
        raise RuntimeError("C++ compile error (simulated)\nmore lines")
    run.compiled = inductor_fails
    index = torch.tensor([5])
    with pytest.warns(RuntimeWarning, match=r"unfused: RuntimeError: C\+\+ compile error \(simulated\)$"):
        _replay(worker, index, table.T.contiguous(), 10)
    assert torch.equal(worker.tensors[10], _chain_in_torch(table, index)) and replies.sent == []


def test_a_row_failing_inside_a_fused_run_is_reported_under_its_own_op():
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    _replay(worker, torch.tensor([1, 3]), table.T.contiguous(), 10)   # compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # the rows failed, not inductor: no warning
        seq = _replay(worker, torch.tensor([1, 70]), table.T.contiguous(), 11)   # 70: out of range
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (seq, "index_select", "IndexError")
    assert worker.shards.poisoned == {11: seq}
    (run,) = _fused_runs(worker)
    # a bad index this call: the next call fuses again, still past dynamo (its call raised too)
    assert not run.replay_only and run.unguarded is not None
    _replay(worker, torch.tensor([2, 0]), table.T.contiguous(), 12)
    _close(worker.tensors[12], _chain_in_torch(table, torch.tensor([2, 0])))
    assert run.unguarded is not None


# --- one worker in process: a training forward's run (AOTAutograd) ----------------------------------
WEIGHT = 3


def _no_dynamo(*tensors):
    raise AssertionError("torch.compile's guarded call was made")


def test_after_its_first_call_a_run_calls_inductors_function_past_dynamo():
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    (run,) = _fused_runs(worker)
    _replay(worker, torch.tensor([0, 6, 2]), table.T.contiguous(), 10)   # compiles; the stand-in checked
    assert run.unguarded is not None
    run.compiled = _no_dynamo
    for out_id, index in ((11, torch.tensor([4, 4, 1])), (12, torch.tensor([3, 0, 5]))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _replay(worker, index, table.T.contiguous(), out_id)
        _close(worker.tensors[out_id], _chain_in_torch(table, index))
    assert replies.sent == []


def test_an_input_of_another_stride_goes_back_to_dynamo_which_recompiles():
    """The signature fixes shapes, not a loaded tensor's strides: inductor's code asserts them,
    and the run then leaves its guards to dynamo (a recompile), with no fallback and eager's values."""
    table = torch.randn(7, 5)
    worker, replies = _fused_worker(table)
    (run,) = _fused_runs(worker)
    _replay(worker, torch.tensor([1, 2]), table.T.contiguous(), 10)
    assert run.unguarded is not None
    index = torch.tensor([6, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no fallback to the rows
        _replay(worker, index, table.T, 11)   # a transposed view: strides (1, 5)
    _close(worker.tensors[11], _chain_in_torch(table, index))
    assert run.unguarded is None and not run.replay_only and replies.sent == []


def test_the_stand_in_is_inductors_function_only_where_dynamos_graph_is_the_pure_function():
    """An unused input (not a placeholder) or one returned as it came (not a graph output):
    dynamo's call, guards and all."""
    def exact(t1, t2):
        return (t1 * 2, t2 + 1)

    def unused(t1, t2):
        return (t1 * 2,)

    def passed_through(t1, t2):
        return (t1 * 2, t2)
    x, y = torch.randn(3), torch.randn(3)
    for function, returns, usable in ((exact, 2, True), (unused, 1, False), (passed_through, 2, False)):
        inductor = fusion._Inductor()
        torch.compile(function, backend=inductor, dynamic=False, fullgraph=True)(x, y)
        stand_in = inductor.stand_in(["L_t1_", "L_t2_"], returns)
        assert (stand_in is not None) == usable, function.__name__
        if usable:
            _close(torch.stack(list(stand_in(x, y))), torch.stack(list(exact(x, y))))


def _training_rows(tail: str = "sum") -> tuple:
    """loss = (relu(x @ w) * 2).<tail>(), every row recorded for backward (w requires grad);
    tail "views": y = linear(x, w); loss = (y.reshape(4, 3, 2, 2) * 2).sum()."""
    product, active, scaled, loss = (TensorId(CAPTURED + i) for i in range(1, 5))
    commands = [run_op(0, product, "matmul", TensorId(CAPTURED), TensorId(WEIGHT)),
                run_op(1, active, "relu", product),
                run_op(2, scaled, "mul", active, 2.0),
                run_op(3, loss, tail, scaled)]
    if tail == "views":   # linear of a 3-d input is a view of its product; reshape one of that
        commands = [run_op(0, product, "linear", TensorId(CAPTURED), TensorId(WEIGHT), None),
                    run_op(1, active, "reshape", product, [4, 3, 2, 2]),
                    run_op(2, scaled, "mul", active, 2.0), run_op(3, loss, "sum", scaled)]
    return tuple([wire.command_row(c._replace(grad=True)) for c in commands])


def _training_worker(weight: torch.Tensor, tail: str = "sum", scratch: tuple = (1, 2, 3)) -> Worker:
    worker = Worker(0, Replies(), None, CpuDevice(), start_seq=0)
    deliver(worker, lambda s: [
        wire.DefineMesh(s, 0, "cpu", (1,), (0,)),
        wire.Factory(s + 1, WEIGHT, 0, "zeros", tuple(weight.shape), "float32", REPLICATE, ()),
        wire.DefineGraph(s + 2, 7, _training_rows(tail), (CAPTURED,), (CAPTURED + 4,),
                         tuple([CAPTURED + i for i in scratch]), (), (), (), "inductor")])
    worker.tensors[WEIGHT] = weight
    return worker


def _train_replay(worker: Worker, x: torch.Tensor, out_id: int) -> torch.Tensor:
    """One replay, with grad mode off as in a worker process."""
    worker.tensors[INPUT] = x
    with torch.no_grad():
        deliver(worker, lambda s: [wire.RunGraph(s, 7, 4, (INPUT,), (out_id,), 0, 0, (), 2)])
    return worker.tensors[out_id]


def test_a_training_run_is_one_compiled_autograd_node_whose_gradient_equals_torch():
    weight = torch.randn(5, 3).requires_grad_()
    worker = _training_worker(weight)
    (run,) = _fused_runs(worker)
    assert run.records and run.probing
    for out_id in (10, 11, 12):
        x = torch.randn(4, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # no fallback
            loss = _train_replay(worker, x, out_id)
        weight.grad = None
        loss.backward()
        reference = weight.detach().clone().requires_grad_()
        want = ((x @ reference).relu() * 2.0).sum()
        want.backward()
        _close(loss.detach(), want.detach())
        _close(weight.grad, reference.grad)
        # the first call ran the rows (one node per op); then the compiled function: one node
        assert (type(loss.grad_fn).__name__ == "CompiledFunctionBackward") == (out_id != 10)
    assert not run.replay_only and not run.probing


def test_a_parameter_that_starts_requiring_grad_goes_back_to_dynamo():
    """requires_grad decides what AOTAutograd compiled (with no input requiring grad, a function
    that records nothing); the signature does not fix a loaded parameter's, so the unguarded call
    checks it per call (FusedRun._invoke), and dynamo compiles the function that records."""
    weight = torch.randn(5, 3).requires_grad_()
    worker = _training_worker(weight)
    (run,) = _fused_runs(worker)
    worker.tensors[WEIGHT] = frozen = weight.detach()
    for out_id in (10, 11):
        assert not _train_replay(worker, torch.randn(4, 5), out_id).requires_grad
    assert run.unguarded is not None
    worker.tensors[WEIGHT] = weight
    for out_id in (12, 13):
        x = torch.randn(4, 5)
        loss = _train_replay(worker, x, out_id)
        weight.grad = None
        loss.backward()
        reference = weight.detach().clone().requires_grad_()
        ((x @ reference).relu() * 2.0).sum().backward()
        _close(weight.grad, reference.grad)
    worker.tensors[WEIGHT] = frozen
    x = torch.randn(4, 5)
    _close(_train_replay(worker, x, 14), ((x @ frozen).relu() * 2.0).sum())


def test_a_fused_training_run_stores_views_that_require_grad_as_the_rows_do():
    """reshape(linear(x, w)) of a 3-d x: outputs that are views of one intermediate. AOTAutograd
    rebuilds them outside the compiled function, in the caller's grad mode (FusedRun._call turns
    it on; with it off, they would not require grad and the probe would keep the rows)."""
    weight = torch.randn(4, 5).requires_grad_()
    worker = _training_worker(weight, tail="views", scratch=())
    for out_id in (10, 11, 12):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # the probe found nothing to keep the rows for
            _train_replay(worker, torch.randn(4, 3, 5), out_id)
        stored = [worker.tensors[CAPTURED + i] for i in (1, 2, 3)] + [worker.tensors[out_id]]
        assert all(t.requires_grad for t in stored)
    (run,) = _fused_runs(worker)
    assert not run.replay_only


class _GatherAgain:
    """A stand-in for fsdp's recipe (kernels.pack_saved): counts the gathers backward asks for."""

    def __init__(self, whole: torch.Tensor):
        self.whole, self.gathers = whole, 0

    def gather_again(self) -> torch.Tensor:
        self.gathers += 1
        return self.whole.detach()


def test_a_fused_training_run_saves_a_gathered_parameter_as_the_way_to_gather_it_again():
    weight = torch.randn(5, 3).requires_grad_()
    worker = _training_worker(weight)
    for out_id in (10, 11):
        x = torch.randn(4, 5).requires_grad_()   # an activation: the product saves the weight for x's gradient
        gathered = (weight * 1.0)   # as fsdp's all-gather gives it: a non-leaf of the shard
        recipe = _GatherAgain(gathered)
        gathered._dtorch_regather = recipe
        worker.tensors[WEIGHT] = gathered
        loss = _train_replay(worker, x, out_id)
        assert recipe.gathers == 0
        weight.grad = None
        loss.backward()
        assert recipe.gathers >= 1   # backward gathered it again: the forward did not keep it
        reference = weight.detach().clone().requires_grad_()
        ((x @ (reference * 1.0)).relu() * 2.0).sum().backward()
        _close(weight.grad, reference.grad)
    assert type(loss.grad_fn).__name__ == "CompiledFunctionBackward"


def test_a_training_run_whose_rows_join_an_output_keeps_the_rows_and_warns_once():
    """detach's output does not depend on w, and the rows join it to w (backward.run_recorded);
    the fused function would leave it out of the graph, so the run stays the rows."""
    weight = torch.randn(5, 3).requires_grad_()
    worker = _training_worker(weight, tail="detach")
    with pytest.warns(RuntimeWarning, match=r"unfused: t104 would be requires_grad=False .* as the rows record it"):
        first = _train_replay(worker, torch.randn(4, 5), 10)
    assert first.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # once
        assert _train_replay(worker, torch.randn(4, 5), 11).requires_grad
    (run,) = _fused_runs(worker)
    assert run.replay_only


def test_a_fused_graph_updates_with_torchs_foreach_kernels_unless_the_user_chose():
    """foreach None (torch's default) becomes foreach=True in a fused graph's optimizer rows;
    the user's own choice stands, and a replayed graph keeps the single-tensor path."""
    def defined(backend: str, path: dict):
        worker = Worker(0, Replies(), None, CpuDevice(), start_seq=0)
        step = wire.OptimizerStep(0, 0, "AdamW", {"lr": 0.1, **path}, (TABLE,), (INPUT,), (), (0,), (1,))
        deliver(worker, lambda s: [wire.DefineMesh(s, 0, "cpu", (1,), (0,)),
                                   wire.DefineGraph(s + 1, 7, (wire.command_row(step),), (), (), (), (), (0,), (),
                                                    backend)])
        graph = worker.graph_commands.graphs[7]
        assert graph.rows[0][1] == tuple(graph.commands[0])[1:]   # what a replay builds its row from
        return graph.commands[0].hyper
    assert defined("inductor", {"foreach": None, "fused": False})["foreach"] is True
    assert defined("inductor", {"foreach": False, "fused": False})["foreach"] is False
    assert defined("inductor", {"foreach": None, "fused": True})["foreach"] is None
    assert defined("", {"foreach": None, "fused": False})["foreach"] is None


# --- whole sessions: fused equals eager ---------------------------------------------------------------
def _chain(x, w):
    y = (x @ w).relu() * 1.5 + 0.25
    return (y.sin() + y.cos()).tanh() - x


@pytest.mark.parametrize("mesh_name, placement, rows", [("mesh1", Replicate(), 64), ("mesh4", Shard(0), 37),
                                                         ("mesh4", Replicate(), 37), ("mesh4", Shard(0), 3)])
def test_a_fused_chain_equals_eager(request, mesh_name, placement, rows):
    mesh = request.getfixturevalue(mesh_name)
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(128, 128, generator=g) / 10
    w = dtorch.tensor(weight, device_mesh=mesh, placements=[Replicate()])
    fused = dtorch.compile(_chain, backend="inductor")
    for _ in range(3):   # capture, then two fused replays
        x = torch.randn(rows, 128, generator=g)
        got = fused(dtorch.tensor(x, device_mesh=mesh, placements=[placement]), w)
        _close(got.to_torch(), _chain(x, weight))
    assert fused.captures == 1 and fused.replays == 2


def test_random_rows_stay_outside_fused_runs_and_equal_eager_bit_for_bit(mesh4):
    def noisy(x):
        a = x * 2.0 + 1.0
        dropped = torch.nn.functional.dropout(a, 0.5)
        noise = dtorch.rand_like(x)
        return dropped, noise, ((dropped * noise).sin() + 1.0).log()

    fused = dtorch.compile(noisy, backend="inductor")
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(10, 6, generator=g) for _ in range(3)]
    results = []
    for compiled in (False, True):
        dtorch.manual_seed(11)
        run = fused if compiled else noisy
        results.append([[t.to_torch() for t in run(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]))]
                        for x in inputs])
    for call, (eager, got) in enumerate(zip(*results)):
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), call
        _close(got[2], eager[2], f"call {call}")
    assert fused.replays == 2


def test_a_llama_forward_fuses_and_equals_eager(mesh4):
    transformers = pytest.importorskip("transformers")
    from dtorch.models import LlamaForCausalLM
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, device_mesh=mesh4)
    model.load_state_dict(transformers.LlamaForCausalLM(config).state_dict())
    g = torch.Generator().manual_seed(3)
    batches = [dtorch.tensor(torch.randint(0, 96, (4, 12), generator=g), device_mesh=mesh4, placements=[Shard(0)])
               for _ in range(3)]

    def forward(ids):
        with dtorch.no_grad():
            return model(ids).logits
    fused = dtorch.compile(forward, backend="inductor")
    for ids in batches:
        _close(fused(ids).to_torch(), forward(ids).to_torch())
    assert fused.replays == 2


def test_a_failure_inside_a_fused_run_names_the_op_and_the_line(mesh4):
    table = dtorch.randn(5, 3, device_mesh=mesh4, placements=[Replicate()])

    def lookup(index):
        picked = table.index_select(0, index)   # FUSED FAILS HERE
        return (picked * 2).sin()
    compiled = dtorch.compile(lookup, backend="inductor")
    good = dtorch.tensor(torch.tensor([0, 4, 1, 2]), device_mesh=mesh4, placements=[Shard(0)])
    compiled(good).to_torch()
    _close(compiled(good).to_torch(), (table.to_torch()[[0, 4, 1, 2]] * 2).sin())   # fused
    bad = dtorch.tensor(torch.tensor([0, 9, 1, 2]), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(RemoteError) as raised:
        compiled(bad).to_torch()
    assert "index_select" in str(raised.value)
    assert re.search(rf"test_compile_fusion.py:{_line_of('FUSED FAILS HERE')} \(replayed, in the compiled call at",
                     str(raised.value))


def test_an_unknown_backend_is_refused_naming_the_legal_ones():
    with pytest.raises(ValueError, match=r"backend must be one of None, 'replay', 'inductor', got 'tensorrt'"):
        dtorch.compile(_chain, backend="tensorrt")


_WITHOUT_COMPILER = textwrap.dedent("""
    import warnings, torch, dtorch
    from dtorch.spec.placements import Replicate, init_device_mesh
    dtorch.init(num_workers=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = dtorch.tensor(torch.ones(8, 16), device_mesh=mesh, placements=[Replicate()])
        step = dtorch.compile(lambda x: ((x * 3.0).sin() + 1.0).exp(), backend="inductor")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                out = step(x).to_torch()
        for w in caught:
            print("WARNING", w.category.__name__, w.lineno, w.message)
        print("EQUAL", torch.equal(out, ((torch.ones(8, 16) * 3.0).sin() + 1.0).exp()))
    finally:
        dtorch.shutdown()
""")


def test_workers_without_a_cpp_compiler_replay_and_the_user_is_warned_once_at_the_line():
    """The workers' environment: CXX names no compiler. Every call is right; one warning, shown
    by the controller at the line of the run's ops (line 8 of the program: the lambda)."""
    result = subprocess.run([sys.executable, "-c", _WITHOUT_COMPILER], env=dict(os.environ, CXX="no-such-compiler"),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    warned = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith("WARNING RuntimeWarning 8 "), result.stdout
    assert "run as the replay, unfused: no C++ compiler ('no-such-compiler' is not on PATH" in warned[0]
    assert "EQUAL True" in result.stdout


# --- the longer sweep: DTORCH_FUSION_SWEEP=1 ----------------------------------------------------------
# Each graph compiles for seconds, so CI runs none of these: `DTORCH_FUSION_SWEEP=1 python -m pytest
# tests/test_compile_fusion.py -k sweep` runs test_compile's random chains (collectives, dropout,
# randn_like, softmax, matmuls between them) fused on mesh4 and mesh22 against eager.
SWEEP = pytest.mark.skipif(not os.environ.get("DTORCH_FUSION_SWEEP"),
                           reason="compiles one graph per case for seconds: set DTORCH_FUSION_SWEEP=1")


@SWEEP
@pytest.mark.parametrize("seed", range(12))
def test_sweep_random_chains_fused_equal_eager(seed, mesh4, mesh22, automatic):
    from test_compile import _random_chain
    mesh = mesh4 if seed % 2 else mesh22
    chain, rng = _random_chain(seed, mesh)
    fused = dtorch.compile(chain, backend="inductor")
    placements = [rng.choice([Shard(0), Shard(1), Replicate()]) for _ in range(mesh.ndim)]
    for call in range(3):
        x = dtorch.randn(10, 6, device_mesh=mesh, placements=placements)
        y = dtorch.randn(10, 6, device_mesh=mesh, placements=placements)
        dtorch.manual_seed(100 + call)
        got = fused(x, y).to_torch()
        dtorch.manual_seed(100 + call)
        _close(got, chain(x, y).to_torch(), f"call {call}")
    assert fused.captures == 1


# --- the cache: a second process compiles nothing ------------------------------------------------------
_PROGRAM = textwrap.dedent("""
    import torch, dtorch
    from dtorch.spec.placements import Replicate, init_device_mesh
    dtorch.init(num_workers=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = dtorch.tensor(torch.ones(8, 16), device_mesh=mesh, placements=[Replicate()])
        step = dtorch.compile(lambda x: ((x * 3.0).sin() + 1.0).exp(), backend="inductor")
        for _ in range(2):
            step(x).to_torch()
    finally:
        dtorch.shutdown()
""")


def _cached_graphs(cache: str) -> set:
    found = set()
    for folder, _, files in os.walk(os.path.join(cache, "fxgraph")):
        found.update(os.path.join(folder, f) for f in files)
    return found


def test_a_second_process_reuses_the_compiled_runs_from_the_disk_cache(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, timeout=240)
    first = _cached_graphs(str(tmp_path / "inductor"))
    assert first, "the first process's workers wrote no compiled graph to the shared cache"
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, timeout=240)
    assert _cached_graphs(str(tmp_path / "inductor")) == first   # cache hits: nothing compiled again


def test_the_fused_chain_benchmark_runs():
    """benchmarks/fused_chain.py (docs/design/compile.md quotes it), its smoke variant: 1 worker,
    a 10-op chain, the host's cache (warm after its first run)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "benchmarks.fused_chain", "--smoke"], cwd=root,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for row in ("torch eager", "torch.compile, 1 process", "dtorch fused, 1 worker(s)", "dtorch replay, 1 worker(s)",
                "first fused replay (compiles)"):
        assert row in result.stdout, (row, result.stdout)
