"""A redistribute step that fails on one rank only must not leave its peers in a collective.

Two real Workers (threads of this process, real Gloo over a TCPStore) run the same commands; an
injected MemoryError hits one rank's local work before or after a collective, as running out of
memory would. The peer must finish every step (Gloo's timeout is set short, so a missed collective
fails the test in seconds instead of hanging), and the failing rank must report the error and
poison its output. Through the whole runtime, a read then raises (tests/test_errors.py).
"""
import itertools
import threading

import pytest
import torch
import torch.distributed as dist

from dtorch.distributed_spec import Partial, Replicate, Shard
from dtorch.runtime import kernels
from dtorch.runtime import protocol as wire
from dtorch.runtime.comm import GlooCommunicator
from dtorch.runtime.devices import CpuDevice
from dtorch.runtime.worker import Worker

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
        worker.comm.close()
    return workers


COMMANDS = [(wire.DefineMesh, 0, "cpu", (2,), (0, 1)),
            (wire.Factory, 1, 0, "full", (6, 4), "float32", (Shard(0),), (3.0,)),
            (wire.Redistribute, 2, 1, 0, (6, 4), "float32", (Shard(0),), STEPS)]


def fail_on_rank1(monkeypatch, name: str):
    """The first call of kernels.`name` on rank 1 raises, as an allocation running out would."""
    real, failed = getattr(kernels, name), []

    def failing(*args):
        if threading.current_thread().name == "rank1" and not failed:
            failed.append(name)
            raise MemoryError(f"injected: out of memory in {name}")
        return real(*args)
    monkeypatch.setattr(kernels, name, failing)


def test_both_ranks_finish_without_a_failure():
    workers = run_on_two_ranks(COMMANDS)
    for worker in workers:    # R -> P(sum) keeps the value on coordinate 0 only, so the sum is exact
        assert torch.equal(worker.tensors[2], torch.full((6, 4), 3.0))


@pytest.mark.parametrize("where", ["_pad_to", "_join_pieces"], ids=["before its collective", "after it"])
def test_a_step_failing_on_one_rank_leaves_the_peer_free(monkeypatch, where):
    fail_on_rank1(monkeypatch, where)
    healthy, failed = run_on_two_ranks(COMMANDS)
    assert not healthy.sockets.sent, healthy.sockets.sent     # rank 0 finished without an error
    assert 2 in healthy.tensors and 2 not in healthy.poisoned
    assert failed.poisoned.get(2) == 2 and 2 not in failed.tensors
    kind, seq, rank, op, error_type, message = failed.sockets.sent[-1][1:7]
    assert (kind, seq, rank, error_type) == (wire.Kind.ERROR, 2, 1, "MemoryError") and where in message
