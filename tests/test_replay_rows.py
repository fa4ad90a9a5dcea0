"""A worker replaying a compiled graph (RunGraph), in process: plain op rows run inline
(Worker._run_replayed_row), every other row through the general per-command path. Both must
leave the same tensors, the same poison and the same error reports; and the values must be
torch's on the same inputs. The whole-session tests are in test_compile.py."""
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


def graph_rows() -> tuple:
    """picked = table.index_select(0, index); scaled = picked * 2; shifted = scaled.add(1, alpha=3)
    (kwargs: the general path); del picked; out = shifted - 0.5. The ids are the capture's."""
    x, picked, scaled, shifted, out = (TensorId(CAPTURED + i) for i in range(5))
    rows = [run_op(0, picked, "index_select", TensorId(TABLE), 0, x),
            run_op(1, scaled, "mul", picked, 2),
            run_op(2, shifted, "add", scaled, 1, kwargs={"alpha": 3}),
            wire.Free(3, (picked,)),
            run_op(4, out, "sub", shifted, 0.5)]
    return tuple(wire.command_row(r) for r in rows)


def expected(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.add(table.index_select(0, index) * 2, 1, alpha=3) - 0.5


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
    if path == "general":   # every row through _run_command, as before plain rows ran inline
        worker._run_replayed_row = worker._run_command
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
