"""A worker running plain ops inline (Worker._ran_inline), in process: in an eager batch and in a
replay of a compiled graph (RunGraph), plain op commands run inline and everything else through
the general per-command path (Worker._execute). Both ways must leave the same tensors, the same
poison and the same error reports; and the values must be torch's on the same inputs. The
whole-session tests are in test_compile.py and the op sweeps."""
import pytest
import torch
import zmq

from dtorch.distributed_spec import Replicate
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices import CpuDevice
from dtorch.runtime.worker import Worker

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


def program(first_seq: int, first_id: int) -> list:
    """picked = table.index_select(0, index); scaled = picked * 2; shifted = scaled.add(1, alpha=3)
    (a scalar kwarg); del picked; out = shifted.sum(dim=[0]) (a list kwarg: the general path);
    `first_id` is index's id, the others follow it."""
    x, picked, scaled, shifted, out = (TensorId(first_id + i) for i in range(5))
    commands = [run_op(0, picked, "index_select", TensorId(TABLE), 0, x),
                run_op(1, scaled, "mul", picked, 2),
                run_op(2, shifted, "add", scaled, 1, kwargs={"alpha": 3}),
                wire.Free(3, (picked,)),
                run_op(4, out, "sum", shifted, kwargs={"dim": [0]})]
    return [c._replace(seq=first_seq + c.seq) for c in commands]


def graph_rows() -> tuple:
    """The program as a graph's rows: the capture's ids."""
    return tuple(wire.command_row(c) for c in program(0, CAPTURED))


def expected(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.add(table.index_select(0, index) * 2, 1, alpha=3).sum(dim=[0])


def fresh_worker(table: torch.Tensor) -> tuple[Worker, Replies]:
    replies = Replies()
    worker = Worker(0, replies, None, CpuDevice(), start_seq=0)
    deliver(worker, lambda s: [
        wire.DefineMesh(s, 0, "cpu", (1,), (0,)),
        wire.Factory(s + 1, TABLE, 0, "zeros", tuple(table.shape), "float32", REPLICATE, ()),
        wire.DefineGraph(s + 2, 7, graph_rows(), (CAPTURED,), (CAPTURED + 4,),
                         (CAPTURED + 1, CAPTURED + 2, CAPTURED + 3), (), ())])
    worker.tensors[TABLE] = table.clone()
    return worker, replies


def replay(worker: Worker, index: torch.Tensor, out_id: int) -> int:
    """Bind `index` to a fresh id, replay graph 7 on it into `out_id`; the RunGraph's seq."""
    worker.tensors[INDEX] = index
    seq = worker.next_seq
    deliver(worker, lambda s: [wire.RunGraph(s, 7, len(graph_rows()), (INDEX,), (out_id,), 0, 0, (), 2)])
    return seq


@pytest.fixture(params=["inline", "general"])
def path(request):
    return request.param


def worker_on(path: str, table: torch.Tensor) -> tuple[Worker, Replies]:
    worker, replies = fresh_worker(table)
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
    assert not worker.poisoned


def test_a_row_that_fails_in_a_replay_is_reported_under_its_own_seq_and_poisons_what_follows(path):
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    seq = replay(worker, torch.tensor([0, 9]), 10)   # 9 is out of range: index_select raises
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (seq, "index_select", "IndexError")
    assert worker.poisoned == {10: seq}   # the graph's output, poisoned by the failing row
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
    assert worker.poisoned == {10: seq}


def test_an_eager_batch_computes_what_torch_computes(path):
    table = torch.randn(5, 3)
    worker, replies = worker_on(path, table)
    index = torch.tensor([4, 0, 0])
    worker.tensors[INDEX] = index
    deliver(worker, lambda s: program(s, INDEX))
    assert torch.equal(worker.tensors[INDEX + 4], expected(table, index))
    assert set(worker.tensors) == {TABLE, INDEX, INDEX + 2, INDEX + 3, INDEX + 4}   # picked was freed
    assert replies.sent == [] and not worker.poisoned


def test_an_eager_op_that_fails_is_reported_and_poisons_what_follows(path):
    worker, replies = worker_on(path, torch.randn(5, 3))
    worker.tensors[INDEX] = torch.tensor([7])
    first = worker.next_seq
    deliver(worker, lambda s: program(s, INDEX))
    (report,) = replies.reports()
    assert (report.seq, report.op, report.exception_type) == (first, "index_select", "IndexError")
    # picked (failed) was then freed; the ops after it are poisoned by it
    assert worker.poisoned == {INDEX + 2: first, INDEX + 3: first, INDEX + 4: first}
    assert worker.busy_seq == -1
