"""A worker's three routes for plain ops, in process: a replay of a compiled graph (RunGraph) runs
its rows as one generated function where they all qualify (runtime/worker/straight_line.py); otherwise
rows, and the commands of an eager batch, run inline when plain (Worker._ran_inline) and through
the general per-command path (Worker._execute) when not. Every route must leave the same tensors,
the same poison and the same error reports; and the values must be torch's on the same inputs.
The whole-session tests are in test_compile.py and the op sweeps."""
import pytest
import torch
import zmq

from dtorch.spec.placements import Replicate, ShardRegion
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices.device import CpuDevice
from dtorch.runtime.worker.worker import Worker

pytestmark = pytest.mark.timeout(60)

TABLE, INDEX, CAPTURED = 1, 2, 100   # the capture's ids start at 100
REPLICATE = (Replicate(),)


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(bytes(frames[0]))

    def reports(self) -> list:
        return [wire.decode(frame, (wire.ErrorReport,)) for frame in self.sent]


def deliver(worker: Worker, make_commands) -> None:
    """`make_commands(first_seq)` as one batch through the worker's entry point for a message."""
    frames = wire.encode_batch(worker.next_seq, make_commands(worker.next_seq))
    worker._on_message([zmq.Frame(f) for f in frames])


def run_op(seq: int, out: int, op: str, *args, kwargs=None) -> wire.RunOp:
    args = tuple(wire.TensorRef(a) if type(a) is TensorId else a for a in args)
    return wire.RunOp(seq, (out,), 0, op, op, args, kwargs or {}, ())


class TensorId(int):
    """An argument that names a tensor (a bare int is a scalar)."""


def program(first_seq: int, first_id: int, dim: int = 0) -> list:
    """picked = table.index_select(0, index); scaled = picked * 2; shifted = scaled.add(1, alpha=3)
    (a scalar kwarg); del picked; out = shifted.sum(dim=[dim]) (a list kwarg: the general path in
    eager); `first_id` is index's id, the others follow it."""
    x, picked, scaled, shifted, out = (TensorId(first_id + i) for i in range(5))
    commands = [run_op(0, picked, "index_select", TensorId(TABLE), 0, x),
                run_op(1, scaled, "mul", picked, 2),
                run_op(2, shifted, "add", scaled, 1, kwargs={"alpha": 3}),
                wire.Free(3, (picked,)),
                run_op(4, out, "sum", shifted, kwargs={"dim": [dim]})]
    return [c._replace(seq=first_seq + c.seq) for c in commands]


def graph_rows(dim: int = 0) -> tuple:
    """The program as a graph's rows: the capture's ids."""
    return tuple(wire.command_row(c) for c in program(0, CAPTURED, dim))


def expected(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.add(table.index_select(0, index) * 2, 1, alpha=3).sum(dim=[0])


def fresh_worker(table: torch.Tensor, dim: int = 0) -> tuple[Worker, Replies]:
    replies = Replies()
    worker = Worker(0, replies, None, CpuDevice(), start_seq=0)
    deliver(worker, lambda s: [
        wire.DefineMesh(s, 0, "cpu", (1,), (0,)),
        wire.Factory(s + 1, TABLE, 0, "zeros", tuple(table.shape), "float32", REPLICATE, ()),
        wire.DefineGraph(s + 2, 7, graph_rows(dim), (CAPTURED,), (CAPTURED + 4,),
                         (CAPTURED + 1, CAPTURED + 2, CAPTURED + 3), (), ())])
    worker.tensors[TABLE] = table.clone()
    return worker, replies


def replay(worker: Worker, index: torch.Tensor, out_id: int) -> int:
    """Bind `index` to a fresh id, replay graph 7 on it into `out_id`; the RunGraph's seq."""
    worker.tensors[INDEX] = index
    seq = worker.next_seq
    deliver(worker, lambda s: [wire.RunGraph(s, 7, len(graph_rows()), (INDEX,), (out_id,), 0, 0, (), 2)])
    return seq


@pytest.fixture(params=["program", "inline", "general"])
def path(request):
    return request.param


def worker_on(path: str, table: torch.Tensor, dim: int = 0) -> tuple[Worker, Replies]:
    worker, replies = fresh_worker(table, dim)
    assert runs(worker.graph_commands.graphs[7]) == [(0, 5)]   # every row qualifies: one function
    if path != "program":   # the replay runs row by row, as before graphs became functions
        worker.graph_commands.graphs[7] = worker.graph_commands.graphs[7]._replace(plan=None)
    if path == "general":   # every command through _execute, as before plain ops ran inline
        worker._ran_inline = lambda command: False
    return worker, replies


def test_a_replay_computes_what_torch_computes_and_frees_its_scratch(path):
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    for out_id, index in ((10, torch.tensor([0, 4, 1])), (11, torch.tensor([2, 2]))):
        replay(worker, index, out_id)
        assert torch.equal(worker.tensors[out_id], expected(table, index))
    assert replies.sent == []
    assert set(worker.tensors) == {TABLE, INDEX, 10, 11}   # no scratch, no capture id left behind
    assert not worker.shards.poisoned


def test_a_row_that_fails_in_a_replay_is_reported_under_its_own_seq_and_poisons_what_follows(path):
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    seq = replay(worker, torch.tensor([0, 9]), 10)   # 9 is out of range: index_select raises
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (seq, "index_select", "IndexError")
    assert worker.shards.poisoned == {10: seq}   # the graph's output, poisoned by the failing row
    assert set(worker.tensors) == {TABLE, INDEX}
    assert worker.busy_seq == -1
    replay(worker, torch.tensor([3]), 11)   # the next replay is unharmed
    assert torch.equal(worker.tensors[11], expected(table, torch.tensor([3])))
    assert len(replies.sent) == 1


def test_a_missing_input_row_takes_the_general_path_and_names_the_tensor(path):
    worker, replies = worker_on(path, torch.randn(5, 3))
    del worker.tensors[TABLE]
    seq = replay(worker, torch.tensor([0]), 10)
    (report,) = replies.reports()
    assert report.seq == seq and report.exception_type == "KeyError"
    assert f"tensor #{TABLE} is not on rank 0" in report.message
    assert worker.shards.poisoned == {10: seq}


def test_an_eager_batch_computes_what_torch_computes(path):
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    index = torch.tensor([4, 0, 0])
    worker.tensors[INDEX] = index
    deliver(worker, lambda s: program(s, INDEX))
    assert torch.equal(worker.tensors[INDEX + 4], expected(table, index))
    assert set(worker.tensors) == {TABLE, INDEX, INDEX + 2, INDEX + 3, INDEX + 4}   # picked was freed
    assert replies.sent == [] and not worker.shards.poisoned


def test_an_eager_op_that_fails_is_reported_and_poisons_what_follows(path):
    worker, replies = worker_on(path, torch.randn(5, 3))
    worker.tensors[INDEX] = torch.tensor([7])
    first = worker.next_seq
    deliver(worker, lambda s: program(s, INDEX))
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (first, "index_select", "IndexError")
    # picked (failed) was then freed; the ops after it are poisoned by it
    assert worker.shards.poisoned == {INDEX + 2: first, INDEX + 3: first, INDEX + 4: first}
    assert worker.busy_seq == -1


def test_a_row_failing_after_others_keeps_what_they_made_for_the_rows_after_it(path):
    """bad = shifted.sum(dim=[5]) raises; good = shifted * 1 after it still reads shifted, which
    the rows before the failure made: on the program route it must reach the table."""
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    *rows, _ = program(0, CAPTURED)
    shifted, bad, good = CAPTURED + 3, CAPTURED + 4, CAPTURED + 5
    rows += [run_op(4, bad, "sum", TensorId(shifted), kwargs={"dim": [5]}),
             run_op(5, good, "mul", TensorId(shifted), 1)]
    graph = define(worker, tuple(wire.command_row(c) for c in rows), (CAPTURED,), (bad, good),
                   (CAPTURED + 1, CAPTURED + 2, shifted))
    assert runs(graph) == [(0, 6)]
    if path != "program":
        worker.graph_commands.graphs[8] = graph._replace(plan=None)
    index = torch.tensor([1, 2])
    worker.tensors[INDEX] = index
    seq = worker.next_seq
    deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20, 21), 0, 0, (), 2)])
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (seq + 4, "sum", "IndexError")
    if path == "program":   # the traceback quotes the generated row
        assert "t104 = k_sum_4(t103, dim=[5])" in report.traceback
    assert worker.shards.poisoned == {20: seq + 4}
    assert torch.equal(worker.tensors[21], torch.add(table.index_select(0, index) * 2, 1, alpha=3))
    assert set(worker.tensors) == {TABLE, INDEX, 21}   # the scratch dropped, as after a clean replay


def _replays_of_each_kind(worker: Worker) -> None:
    """Graph 8 (below) twice; graph 7: a clean replay, one whose row fails (its output poisoned),
    one whose table input is missing, one whose caller's input is poisoned, and a clean one
    again; graph 8 once more (the session holds poisoned tensors now). Each into a new out id.

    Graph 8 writes its first input's id (as an optimizer step does: the caller's id, 40, follows
    the new value) and the id of the caller's second input (an EMA, 41: the captured id, left
    with the old value, goes)."""
    x, doubled, ema = TensorId(CAPTURED), TensorId(CAPTURED + 1), TensorId(41)
    define(worker, tuple(wire.command_row(c) for c in [run_op(0, doubled, "mul", x, 2),
                                                         run_op(1, x, "add", doubled, 1),
                                                         run_op(2, ema, "mul", TensorId(CAPTURED + 5), 3)]),
           (x, CAPTURED + 5), (doubled,))
    worker.tensors[40], worker.tensors[41] = torch.ones(2), torch.full((2,), 2.0)
    call_graph_8 = lambda out_id: deliver(worker, lambda s: [wire.RunGraph(s, 8, 3, (40, 41), (out_id,), 0, 0, (), 2)])  # noqa: E731
    call_graph_8(21)
    call_graph_8(22)
    replay(worker, torch.tensor([0, 4, 1]), 10)
    replay(worker, torch.tensor([0, 9]), 11)
    table = worker.tensors.pop(TABLE)
    replay(worker, torch.tensor([1]), 12)
    worker.tensors[TABLE] = table
    del worker.tensors[INDEX]
    worker.shards.poisoned[INDEX] = 3   # as a failed command that made it leaves it
    deliver(worker, lambda s: [wire.RunGraph(s, 7, len(graph_rows()), (INDEX,), (13,), 0, 0, (), 2)])
    del worker.shards.poisoned[INDEX]
    replay(worker, torch.tensor([2, 2]), 14)
    call_graph_8(23)


def test_a_replay_with_nothing_to_set_aside_leaves_what_setting_aside_leaves(path, monkeypatch):
    """graphs._replay_clear (the common call: no id of the graph bound, no poison) against
    _replay_setting_aside on the same replays: the same tensors, poison and reports."""
    from dtorch.runtime.worker import graphs
    table = torch.randn(5, 3)
    left = []
    for clear in (True, False):
        monkeypatch.setattr(graphs, "nothing_to_set_aside",
                            graphs.nothing_to_set_aside if clear else lambda graph, run, tables: False)
        worker, replies = worker_on(path, table)
        _replays_of_each_kind(worker)
        left.append(({i: t.tolist() for i, t in worker.tensors.items()}, dict(worker.shards.poisoned),
                     [(r.seq, r.op, r.exception_type) for r in replies.reports()]))
    assert left[0] == left[1]
    tensors, poisoned, reports = left[0]
    assert set(tensors) == {TABLE, INDEX, 10, 14, 21, 22, 23, 40, 41} and set(poisoned) == {11, 12, 13}
    assert [tensors[i] for i in (21, 22, 23, 40, 41)] == [[2.0] * 2, [6.0] * 2, [14.0] * 2, [15.0] * 2, [54.0] * 2]
    assert [op for _, op, _ in reports] == ["index_select", "index_select"]   # the poisoned input: not reported again


def define(worker: Worker, rows: tuple, inputs: tuple, outputs: tuple, scratch: tuple = (), random: tuple = ()):
    """Graph 8 from these rows; the worker's Graph."""
    deliver(worker, lambda s: [wire.DefineGraph(s, 8, rows, inputs, outputs, scratch, random, ())])
    return worker.graph_commands.graphs[8]


def runs(graph) -> list:
    """The graph's plan as (first, stop) for each function and the index of each row alone."""
    return [step if type(step) is int else (step.rows.start, step.rows.stop) for step in graph.plan]


def lone(seq: int, out: int, source: int) -> wire.Redistribute:
    """out = source, as a row that goes alone (a redistribute without steps)."""
    return wire.Redistribute(seq, out, source, 0, (2,), "float32", REPLICATE, ())


@pytest.mark.parametrize("why, lone, random", [
    ("it draws random numbers", run_op(2, CAPTURED + 9, "mul", TensorId(CAPTURED + 2), 2), (2,)),
    ("it is a factory that draws random numbers",
     wire.Factory(2, CAPTURED + 9, 0, "randn", (1,), "float32", REPLICATE, (0, 0)), (2,)),
    ("it is not an op", wire.Redistribute(2, CAPTURED + 9, CAPTURED + 2, 0, (1,), "float32", REPLICATE, ()), ()),
    ("its mesh does not hold this rank",
     run_op(2, CAPTURED + 9, "mul", TensorId(CAPTURED + 2), 2)._replace(mesh_id=3), ()),
    ("it takes a dict", run_op(2, CAPTURED + 9, "mul", TensorId(CAPTURED + 2), {"a": 1}), ()),
    ("a kwarg is named like a Python keyword",
     run_op(2, CAPTURED + 9, "mul", TensorId(CAPTURED + 2), 2, kwargs={"lambda": 1}), ()),
    ("it frees nothing", wire.Free(2, ()), ()),
    ("it takes a block as a positional argument",
     run_op(2, CAPTURED + 9, "narrow_region", TensorId(CAPTURED + 2), ShardRegion((4,), REPLICATE)), ()),
])
def test_a_row_that_does_not_qualify_goes_alone_between_two_functions(why, lone, random):
    worker, _ = fresh_worker(torch.zeros(1))
    deliver(worker, lambda s: [wire.DefineMesh(s, 3, "cpu", (1,), (1,))])   # rank 1 only
    x, a, b, d, e = CAPTURED, CAPTURED + 1, CAPTURED + 2, CAPTURED + 3, CAPTURED + 4
    rows = (run_op(0, a, "mul", TensorId(x), 2), run_op(1, b, "add", TensorId(a), 1), lone,
            run_op(3, d, "mul", TensorId(b), 3), run_op(4, e, "mul", TensorId(d), TensorId(d)))
    graph = define(worker, tuple(wire.command_row(c) for c in rows), (x,), (e,), (a, b, d), random)
    assert runs(graph) == [(0, 2), 2, (3, 5)], why
    assert "t102 = tensors[102]" in graph.plan[2].source   # the second run reads what the first stored


def test_a_graph_without_two_plain_ops_in_a_row_has_no_plan():
    worker, _ = fresh_worker(torch.zeros(1))
    rows = (run_op(0, CAPTURED + 1, "mul", TensorId(CAPTURED), 2), lone(1, CAPTURED + 2, CAPTURED + 1))
    assert define(worker, tuple(wire.command_row(c) for c in rows), (CAPTURED,), (CAPTURED + 2,)).plan is None


@pytest.mark.parametrize("fails", [False, True])
def test_a_plan_of_two_functions_around_a_lone_row_leaves_what_row_by_row_leaves(fails):
    """a = x * 2; b = a + 1; c = b (a row that goes alone); del a; d = c + b (or, when `fails`,
    c.sum(dim=[4])); e = d * d: the same tensors, poison and reports both ways."""
    x, a, b, c, d, e = (TensorId(CAPTURED + i) for i in range(6))
    rows = (run_op(0, a, "mul", x, 2), run_op(1, b, "add", a, 1), lone(2, c, b), wire.Free(3, (a,)),
            run_op(4, d, "sum", c, kwargs={"dim": [4]}) if fails else run_op(4, d, "add", c, b),
            run_op(5, e, "mul", d, d))
    outcomes = []
    for planned in (True, False):
        worker, replies = fresh_worker(torch.zeros(1))
        graph = define(worker, tuple(wire.command_row(r) for r in rows), (x,), (e,), (a, b, c, d))
        assert runs(graph) == [(0, 2), 2, (3, 6), 3]   # `del a` frees what the first run stored: again after
        if not planned:
            worker.graph_commands.graphs[8] = graph._replace(plan=None)
        worker.tensors[INDEX] = torch.tensor([1.0, 2.0])
        deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20,), 0, 0, (), 1)])
        outcomes.append((dict(worker.tensors), dict(worker.shards.poisoned),
                         [(r.seq, r.op, r.exception_type) for r in replies.reports()]))
    (tensors, poisoned, reports), (tensors_, poisoned_, reports_) = outcomes
    assert tensors.keys() == tensors_.keys() and poisoned == poisoned_ and reports == reports_
    if fails:
        assert poisoned == {20: 4 + 4} and [r[1:] for r in reports] == [("sum", "IndexError")]
    else:
        b_ = torch.tensor([1.0, 2.0]) * 2 + 1
        assert torch.equal(tensors[20], (b_ + b_) ** 2) and torch.equal(tensors_[20], tensors[20])
        assert set(tensors) == {TABLE, INDEX, 20} and not poisoned


def factory_and_frees(fails: bool) -> tuple:
    """a = x * 2; f = zeros (a factory); del x (an input: the table's); b = a + f; del a; c = b *
    3 (or, when `fails`, b.sum(dim=[4])); g = ones (a factory after the failing row); d = c + g."""
    x, a, f, b, c, g, d = (TensorId(CAPTURED + i) for i in range(7))
    return (run_op(0, a, "mul", x, 2), wire.Factory(1, f, 0, "zeros", (2,), "float32", REPLICATE, ()),
            wire.Free(2, (x,)), run_op(3, b, "add", a, f), wire.Free(4, (a,)),
            run_op(5, c, "sum", b, kwargs={"dim": [4]}) if fails else run_op(5, c, "mul", b, 3),
            wire.Factory(6, g, 0, "ones", (2,), "float32", REPLICATE, ()), run_op(7, d, "add", c, g))


@pytest.mark.parametrize("fails", [False, True])
def test_factories_and_frees_of_the_tables_ids_stay_in_the_run_and_leave_what_row_by_row_leaves(fails):
    """The factories go before the run's function, the Free of its input after it: the plan is
    one function, and the tensors, poison and reports are row by row's."""
    rows = factory_and_frees(fails)
    outcomes = []
    for planned in (True, False):
        worker, replies = fresh_worker(torch.zeros(1))
        graph = define(worker, tuple(wire.command_row(r) for r in rows), (CAPTURED,), (CAPTURED + 6,),
                       tuple(CAPTURED + i for i in range(1, 6)))
        assert runs(graph) == [1, 6, (0, 8), 2]
        source = graph.plan[2].source   # x loaded, then let go where its Free stands, table and all
        assert "t100 = tensors[100]" in source and "del t100\n    tensors.pop(100, None)" in source
        if not planned:
            worker.graph_commands.graphs[8] = graph._replace(plan=None)
        worker.tensors[INDEX] = torch.tensor([1.0, 2.0])
        made = []
        worker.graph_commands.runner.run_command = _counting(worker.graph_commands.runner.run_command, made)
        deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20,), 0, 0, (), 1)])
        outcomes.append((dict(worker.tensors), dict(worker.shards.poisoned),
                         [(r.seq, r.op, r.exception_type) for r in replies.reports()], made))
    (tensors, poisoned, reports, made), (tensors_, poisoned_, reports_, made_) = outcomes
    assert tensors.keys() == tensors_.keys() and poisoned == poisoned_ and reports == reports_
    assert sorted(made) == sorted(made_) == [1, 6]   # each factory ran once, planned or not
    assert CAPTURED not in tensors   # the input's Free reached the table (the caller's own id stays)
    if fails:
        assert poisoned == {20: 4 + 5} and [r[1:] for r in reports] == [("sum", "IndexError")]
    else:
        assert torch.equal(tensors[20], torch.tensor([1.0, 2.0]) * 2 * 3 + 1) and torch.equal(tensors_[20], tensors[20])
        assert set(tensors) == {TABLE, INDEX, 20} and not poisoned


def _counting(run_command, made: list):
    """run_command, noting the row of each Factory it runs (graph 8's rows start at seq 4)."""
    def counted(command):
        if type(command) is wire.Factory:
            made.append(command.seq - 4)
        return run_command(command)
    return counted


@pytest.mark.parametrize("why, rows, plan", [
    ("a row reads an input the run freed",
     (run_op(0, CAPTURED + 1, "mul", TensorId(CAPTURED), 2), wire.Free(1, (CAPTURED,)),
      run_op(2, CAPTURED + 2, "add", TensorId(CAPTURED + 1), 1), run_op(3, CAPTURED + 3, "add", TensorId(CAPTURED), 1)),
     [(0, 3), 1, 3]),
    ("a factory rebinds an id the run read",
     (run_op(0, CAPTURED + 1, "mul", TensorId(CAPTURED), 2), run_op(1, CAPTURED + 2, "add", TensorId(CAPTURED + 1), 1),
      wire.Factory(2, CAPTURED, 0, "zeros", (2,), "float32", REPLICATE, ()),
      run_op(3, CAPTURED + 3, "add", TensorId(CAPTURED), 1), run_op(4, CAPTURED + 4, "add", TensorId(CAPTURED + 3), 1)),
     [(0, 2), 2, (2, 5)]),
])
def test_a_run_ends_where_moving_a_factory_or_a_free_would_change_what_a_row_reads(why, rows, plan):
    worker, _ = fresh_worker(torch.zeros(1))
    graph = define(worker, tuple(wire.command_row(c) for c in rows), (CAPTURED,), (), ())
    assert runs(graph) == plan, why


def test_a_multi_output_row_and_a_kept_intermediate_reach_the_table():
    """values, order = x.sort(); y = values + order (a tuple result, one id each); out = y * 2,
    with y also an output: every id left alive that is not scratch is stored."""
    worker, replies = fresh_worker(torch.zeros(1))
    x, values, order, y, out = (TensorId(CAPTURED + i) for i in range(5))
    rows = (wire.RunOp(0, (values, order), 0, "sort", "sort", (wire.TensorRef(x),), {}, ()),
            run_op(1, y, "add", values, order), wire.Free(2, (values, order)), run_op(3, out, "mul", y, 2))
    graph = define(worker, tuple(wire.command_row(c) for c in rows), (x,), (y, out))
    assert runs(graph) == [(0, 4)]
    source = torch.tensor([3.0, 1.0, 2.0])
    worker.tensors[INDEX] = source
    deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20, 21), 0, 0, (), 1)])
    sorted_values, order_ = source.sort()
    assert torch.equal(worker.tensors[20], sorted_values + order_)
    assert torch.equal(worker.tensors[21], (sorted_values + order_) * 2)
    assert set(worker.tensors) == {TABLE, INDEX, 20, 21} and replies.sent == []


def test_rows_with_tensor_lists_dtypes_and_infinite_scalars_run_as_the_program_and_as_torch():
    """joined = cat([x, y]); total = joined.sum(dtype=float64); scaled = joined * inf: a list of
    tensors, a dtype and a scalar repr cannot write, each as the program passes them."""
    worker, replies = fresh_worker(torch.zeros(1))
    x, y, joined, total, scaled = (TensorId(CAPTURED + i) for i in range(5))
    rows = (run_op(0, joined, "cat", [x, y]), run_op(1, total, "sum", joined, kwargs={"dtype": torch.float64}),
            run_op(2, scaled, "mul", joined, float("inf")))
    rows = tuple(c._replace(args=tuple([wire.TensorRef(i) for i in a] if type(a) is list else a for a in c.args))
                 for c in rows)
    graph = define(worker, tuple(wire.command_row(c) for c in rows), (x, y), (total, scaled))
    assert "k_cat_0([t100, t101])" in graph.plan[0].source
    first, second = torch.tensor([1.0, -2.0]), torch.tensor([0.0])
    worker.tensors.update({INDEX: first, INDEX + 1: second})
    deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX, INDEX + 1), (20, 21), 0, 0, (), 1)])
    joined_ = torch.cat([first, second])
    assert worker.tensors[20].dtype == torch.float64
    assert torch.equal(worker.tensors[20], joined_.sum(dtype=torch.float64))
    torch.testing.assert_close(worker.tensors[21], joined_ * float("inf"), rtol=0, atol=0, equal_nan=True)  # 0 * inf
    assert replies.sent == []


def test_while_a_function_runs_the_heartbeat_names_its_first_row(monkeypatch):
    """After a lone row, which clears busy_seq when done, a run's function still counts as busy
    (a hang inside it is found and named)."""
    from dtorch.ops import KERNELS
    seen = []
    worker, _ = fresh_worker(torch.zeros(1))
    monkeypatch.setitem(KERNELS, "probe", lambda x: (seen.append(worker.busy_seq), x * 1)[1])
    x, a, b, c, d, e = (TensorId(CAPTURED + i) for i in range(6))
    rows = (run_op(0, a, "mul", x, 2), run_op(1, b, "add", a, 1), lone(2, c, b),
            run_op(3, d, "mul", c, 2), run_op(4, e, "probe", d))
    graph = define(worker, tuple(wire.command_row(r) for r in rows), (x,), (e,), (a, b, c, d))
    assert runs(graph) == [(0, 2), 2, (3, 5)]
    worker.tensors[INDEX] = torch.ones(2)
    seq = worker.next_seq
    deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20,), 0, 0, (), 1)])
    assert seen == [seq + 3] and worker.busy_seq == -1
    assert torch.equal(worker.tensors[20], torch.full((2,), 6.0))


def test_a_run_python_will_not_compile_goes_row_by_row(monkeypatch):
    """The safety net under the checks: a run whose source is refused leaves its rows alone, and
    the graph still replays (here every row: no plan)."""
    from dtorch.runtime.worker import straight_line

    def refuse(self, name, scratch):
        raise SyntaxError("refused")
    monkeypatch.setattr(straight_line._Writer, "finish", refuse)
    table = torch.randn(5, 3)
    worker, replies = fresh_worker(table)
    assert worker.graph_commands.graphs[7].plan is None
    index = torch.tensor([2, 0])
    replay(worker, index, 10)
    assert torch.equal(worker.tensors[10], expected(table, index)) and replies.sent == []


@pytest.mark.parametrize("fails", [False, True])
def test_rows_recorded_for_backward_run_in_the_function_as_row_by_row_and_as_torch(fails):
    """a = x * 2 and d = a * c recorded for backward, c = x + 1 between them not (grad mode off),
    z = x.detach() recorded (its output joined to x, as where a rank's output does not depend on it), out =
    d.sum() recorded (or, when `fails`, d.sum(dim=[4])): the same tensors, requires_grad flags,
    poison and reports both ways; torch's gradient of x; grad mode off again after the replay."""
    x, a, c, d, z, out = (TensorId(CAPTURED + i) for i in range(6))
    rows = (run_op(0, a, "mul", x, 2)._replace(grad=True), run_op(1, c, "add", x, 1),
            run_op(2, d, "mul", a, c)._replace(grad=True), run_op(3, z, "detach", x)._replace(grad=True),
            run_op(4, out, "sum", d, kwargs={"dim": [4]} if fails else {})._replace(grad=True))
    outcomes = []
    for planned in (True, False):
        worker, replies = fresh_worker(torch.zeros(1))
        graph = define(worker, tuple(wire.command_row(r) for r in rows), (x,), (c, z, out), (a, d))
        assert runs(graph) == [(0, 5)]
        assert "t101 = _recorded(k_mul_0, (t100, ), t100, 2)" in graph.plan[0].source
        assert graph.plan[0].source.count("_grad_mode(") == 4   # on, off for c, on, off at the end
        if not planned:
            worker.graph_commands.graphs[8] = graph._replace(plan=None)
        leaf = torch.tensor([1.0, 2.0], requires_grad=True)
        worker.tensors[INDEX] = leaf
        with torch.no_grad():   # as a worker process runs
            deliver(worker, lambda s: [wire.RunGraph(s, 8, len(rows), (INDEX,), (20, 21, 22), 0, 0, (), 1)])
            assert not torch.is_grad_enabled()
        flags = {i: t.requires_grad for i, t in worker.tensors.items()}
        gradient = None if fails else torch.autograd.grad(worker.tensors[22] + worker.tensors[21].sum(), leaf)[0]
        outcomes.append((dict(worker.tensors), flags, dict(worker.shards.poisoned),
                         [(r.seq, r.op, r.exception_type) for r in replies.reports()], gradient))
    (tensors, flags, poisoned, reports, gradient), (tensors_, flags_, poisoned_, reports_, gradient_) = outcomes
    assert tensors.keys() == tensors_.keys() and flags == flags_ and poisoned == poisoned_ and reports == reports_
    assert flags[20] is False and flags[21] is True   # c made with grad mode off; z joined to x
    if fails:
        assert poisoned == {22: 4 + 4} and [r[1:] for r in reports] == [("sum", "IndexError")]
        return
    leaf = torch.tensor([1.0, 2.0], requires_grad=True)
    want = torch.autograd.grad((leaf * 2 * (leaf.detach() + 1)).sum(), leaf)[0]
    assert torch.equal(tensors[22], tensors_[22]) and torch.equal(gradient, want) and torch.equal(gradient_, want)
    assert not poisoned and not reports


@pytest.mark.parametrize("held", [3, 300], ids=["table smaller than the graph's ids", "table larger"])
def test_a_replay_sets_aside_and_drops_exactly_the_bound_ids_whichever_side_is_smaller(held):
    """graphs.Bindings looks ids up from the smaller side (a table's keys or a graph's id set):
    the ids it sets aside, keeps and drops must be the same either way, and put back unchanged."""
    from dtorch.runtime.worker import graphs
    graph_ids = set(range(1000, 1100))                      # a graph's edges: 100 ids
    bound = {1000, 1050, 1099} if held == 3 else set(range(950, 1250))
    tensors, poisoned = {i: torch.full((1,), float(i)) for i in bound}, {1001: 7}
    bindings = graphs.Bindings((tensors, poisoned, {}))
    bindings.set_aside_ids(graph_ids, keep=(1050,))
    assert sorted(i for i, _ in bindings.set_aside) == sorted((bound | {1001}) & graph_ids - {1050})
    assert set(tensors) == bound - graph_ids | {1050} and not poisoned
    tensors[1020] = torch.zeros(1)                           # a row wrote a scratch id
    bindings.drop_set({1020, 1021, 1050})
    assert set(tensors) == bound - graph_ids
    bindings.put_back()
    assert set(tensors) == bound - {1050} and poisoned == {1001: 7}
    assert all(tensors[i].item() == float(i) for i in tensors)
