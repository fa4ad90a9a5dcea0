"""A redistribute step, a move fused into an op (RunOp.moves) or a move between meshes that fails
on one rank only must not leave its peers in a collective, nor let a receiver keep blocks a failed
sender never filled.

Two real Workers (threads of this process, real Gloo over a TCPStore) run the same commands; an
injected MemoryError hits one rank's local work before or after a collective, as running out of
memory would. The peer must finish every step (Gloo's timeout is set short, so a missed collective
fails the test in seconds instead of hanging), and the failing rank must report the error and
poison its output. Through the whole runtime, a read then raises (tests/test_errors.py).
"""
import threading

import pytest
import torch
import torch.distributed as dist

from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.runtime.worker import kernels
from dtorch.runtime.worker import worker as worker_module
from dtorch.runtime.worker import moves as worker_moves
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices.comm import GlooCommunicator
from dtorch.runtime.devices.device import CpuDevice
from dtorch.runtime.worker.worker import Worker

GLOO_TIMEOUT_S = 8.0
# S(0) -> R (all_gather), R -> P(sum) (local), P(sum) -> R (all_reduce): two collectives.
STEPS = ((0, Shard(0), Replicate()), (0, Replicate(), Partial()), (0, Partial(), Replicate()))


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(wire.read_header(frames[0]))


def run_on_two_ranks(commands) -> list[Worker]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    workers = [Worker(rank, Replies(), GlooCommunicator(f"127.0.0.1:{store.port}", rank, "127.0.0.1", GLOO_TIMEOUT_S),
                      CpuDevice(), start_seq=0) for rank in (0, 1)]

    def run(worker):
        for seq, (cls, *fields) in enumerate(commands):
            worker._execute(cls(seq, *fields))
    threads = [threading.Thread(target=run, args=(w,), name=f"rank{w.rank}") for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * GLOO_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    for worker in workers:
        worker.comms.comm.close()
    return workers


COMMANDS = [(wire.DefineMesh, 0, "cpu", (2,), (0, 1)),
            (wire.Factory, 1, 0, "full", (6, 4), "float32", (Shard(0),), (3.0,)),
            (wire.Redistribute, 2, 1, 0, (6, 4), "float32", (Shard(0),), STEPS)]


def fail_on(monkeypatch, module, name: str, rank: int = 1):
    """The first call of module.`name` on `rank` raises, as an allocation running out would."""
    real, failed = getattr(module, name), []

    def failing(*args):
        if threading.current_thread().name == f"rank{rank}" and not failed:
            failed.append(name)
            raise MemoryError(f"injected: out of memory in {name}")
        return real(*args)
    monkeypatch.setattr(module, name, failing)


def test_both_ranks_finish_without_a_failure():
    workers = run_on_two_ranks(COMMANDS)
    for worker in workers:    # R -> P(sum) keeps the value on coordinate 0 only, so the sum is exact
        assert torch.equal(worker.tensors[2], torch.full((6, 4), 3.0))


@pytest.mark.parametrize("where", ["_pad_to", "_join_pieces"], ids=["before its collective", "after it"])
def test_a_step_failing_on_one_rank_leaves_the_peer_free(monkeypatch, where):
    fail_on(monkeypatch, kernels, where)
    healthy, failed = run_on_two_ranks(COMMANDS)
    assert not healthy.sockets.sent, healthy.sockets.sent     # rank 0 finished without an error
    assert 2 in healthy.tensors and 2 not in healthy.shards.poisoned
    assert failed.shards.poisoned.get(2) == 2 and 2 not in failed.tensors
    kind, seq, rank, op, error_type, message = failed.sockets.sent[-1][1:7]
    assert (kind, seq, rank, error_type) == (wire.Kind.ERROR, 2, 1, "MemoryError") and where in message


# Rank 0 holds the tensor on mesh #0; mesh #1 is rank 1 alone: a move between pipeline stages.
MOVE = [(wire.DefineMesh, 0, "cpu", (1,), (0,)),
        (wire.DefineMesh, 1, "cpu", (1,), (1,)),
        (wire.Factory, 1, 0, "full", (6, 4), "float32", (Shard(0),), (3.0,)),
        (wire.Transfer, 2, 1, 0, 1, (6, 4), "float32", (Shard(0),), (Shard(1),))]


def test_a_move_between_meshes_without_a_failure():
    sender, receiver = run_on_two_ranks(MOVE)
    assert torch.equal(receiver.tensors[2], torch.full((6, 4), 3.0))
    assert not sender.sockets.sent and not receiver.sockets.sent and 2 not in sender.tensors


@pytest.mark.parametrize("failing", [0, 1], ids=["the sender fails", "the receiver fails"])
def test_a_move_failing_on_one_rank_poisons_the_result_and_frees_the_peer(monkeypatch, failing):
    """A sender failing while cutting its blocks still sends (zeros), and the receiver, on another
    mesh, must not keep them: the agreement after the move poisons its result with the move's seq,
    whose error the failing rank reports."""
    fail_on(monkeypatch, worker_moves, "narrow_to_box", rank=failing)
    workers = run_on_two_ranks(MOVE)
    failed, healthy = workers[failing], workers[1 - failing]
    assert not healthy.sockets.sent, healthy.sockets.sent
    assert 2 not in healthy.tensors and 2 not in failed.tensors
    assert workers[1].shards.poisoned.get(2) == 3   # the receiver's output: the move's seq
    kind, seq, rank, op, error_type, message = failed.sockets.sent[-1][1:7]
    assert (kind, seq, rank, error_type) == (wire.Kind.ERROR, 3, failing, "MemoryError")


# An op whose inserted moves ride in its own command (RunOp.moves, runtime/worker/fused_moves.py): x and
# y are S(1); both move S(1) -> S(0) (an all-to-all each) before the add.
TO_ROWS = ((0, Shard(1), Shard(0)),)
FUSED = [(wire.DefineMesh, 0, "cpu", (2,), (0, 1)),
         (wire.Factory, 1, 0, "full", (6, 4), "float32", (Shard(1),), (3.0,)),
         (wire.Factory, 2, 0, "full", (6, 4), "float32", (Shard(1),), (5.0,)),
         (wire.RunOp, (3,), 0, "add", "add", (wire.TensorRef(1), wire.TensorRef(2)), {}, (), False,
          ((0, (6, 4), "float32", (Shard(1),), TO_ROWS, False), (1, (6, 4), "float32", (Shard(1),), TO_ROWS, False)))]


def test_an_op_with_fused_moves_runs_them_on_every_rank():
    for worker in run_on_two_ranks(FUSED):
        assert torch.equal(worker.tensors[3], torch.full((3, 4), 8.0)), worker.rank
        assert set(worker.tensors) == {1, 2, 3} and not worker.sockets.sent   # no moved copy is kept


@pytest.mark.parametrize("where", ["_pad_to", "_join_pieces"], ids=["before its collective", "after it"])
def test_a_fused_move_failing_on_one_rank_still_joins_every_later_move(monkeypatch, where):
    """The first move fails on rank 1; the second move's all-to-all must still be joined there,
    or rank 0 would wait in it. The op's output is poisoned with its seq and the error reported."""
    fail_on(monkeypatch, kernels, where)
    healthy, failed = run_on_two_ranks(FUSED)
    assert not healthy.sockets.sent and 3 in healthy.tensors
    assert failed.shards.poisoned.get(3) == 3 and 3 not in failed.tensors
    kind, seq, rank, op, error_type, message, remote_traceback = failed.sockets.sent[-1][1:8]
    assert (kind, seq, rank, op, error_type) == (wire.Kind.ERROR, 3, 1, "add", "MemoryError") and where in message
    assert "redistribute dtorch inserted before this op: input 0, [S(1)] -> [S(0)]" in remote_traceback


def test_a_poisoned_input_of_a_fused_move_joins_with_zeros_and_poisons_the_op(monkeypatch):
    """x's factory fails on rank 1 (reported under its own seq): the add's moves still run there,
    x's with zeros, and the add's output carries x's failure, not a new one."""
    fail_on(monkeypatch, worker_module, "make_factory")
    healthy, failed = run_on_two_ranks(FUSED)
    assert not healthy.sockets.sent and 3 in healthy.tensors
    assert failed.shards.poisoned.get(1) == 1 and failed.shards.poisoned.get(3) == 1
    assert [header[2] for header in failed.sockets.sent] == [1]   # one report: the factory's
