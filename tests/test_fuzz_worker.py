"""Fuzzing a worker's command stream in-process: damaged batches, private uploads and probes go
through the real Worker's entry point for one message (`Worker._on_message`, what its loop calls
for every message of its SUB socket). Properties: the worker either runs the message (a failing
command becomes that command's error report) or raises one ProtocolError, never anything else;
after a message it ran, the next valid batch computes the right value."""
import resource

import pytest
import torch
import torch.distributed as dist
import zmq
from hypothesis import given
from hypothesis import strategies as st

from dtorch.spec.placements import Shard
from dtorch.errors import ProtocolError
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices.comm import GlooCommunicator
from dtorch.runtime.devices.device import CpuDevice
from dtorch.runtime.worker.worker import Worker
from fuzzing import damaged, fuzz_settings

pytestmark = pytest.mark.timeout(300)


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append([bytes(f) for f in frames])


class OneRankOnly(GlooCommunicator):
    """A damaged command can name ranks that do not exist; a real group would wait for them
    until the Gloo timeout. That is not the protocol's to prevent (such a command is well formed),
    so here a group of more than this rank refuses at once."""

    def group(self, ranks):
        if tuple(ranks) != (self.rank,):
            raise RuntimeError(f"no peers in this test: group {ranks!r}")
        return super().group(ranks)


@pytest.fixture(scope="module")
def comm():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    comm = OneRankOnly(f"127.0.0.1:{store.port}", 0, "127.0.0.1", 5.0)
    yield comm
    comm.close()


def commands(first: int) -> list:
    return [wire.DefineMesh(first, 0, "cpu", (1,), (0,)),
            wire.Factory(first + 1, 1, 0, "arange", (6,), "float32", (Shard(0),), (0.0, 1.0)),
            wire.Upload(first + 2, 2, 0, (2,), "float32", (Shard(0),)),
            wire.RunOp(first + 3, (3,), 0, "add", "add", (wire.TensorRef(1), wire.TensorRef(1)), {}, ()),
            wire.Fetch(first + 4, 3, 0, (0,)),
            wire.Free(first + 5, (1, 3)),
            wire.Sync(first + 6)]


def messages() -> list:
    """Valid messages of every kind a worker receives, as bytes frames."""
    private = [wire.topic_for_rank(0), wire.encode(wire.Private(2)), torch.ones(2).numpy().tobytes()]
    return [wire.encode_batch(0, commands(0)), private, [wire.TOPIC_PROBE, wire.encode(wire.Probe())]]


def deliver(worker, frames) -> None:
    worker._on_message([zmq.Frame(f) for f in frames])


def still_works(worker) -> None:
    """A valid batch after the damaged message: the worker computes and answers correctly."""
    first = worker.next_seq
    batch = [wire.Factory(first, 50, 0, "arange", (4,), "float32", (Shard(0),), (0.0, 1.0)),
             wire.Fetch(first + 1, 50, 0, (0,))]
    before = len(worker.sockets.sent)
    deliver(worker, wire.encode_batch(first, batch))
    replies = worker.sockets.sent[before:]
    header = wire.read_header(replies[-1][0])
    assert header[1] == wire.Kind.REPLY and header[2] == first + 1, header
    assert torch.equal(torch.frombuffer(bytearray(replies[-1][1]), dtype=torch.float32), torch.arange(4.0))


EXAMPLES = fuzz_settings(1500)


@EXAMPLES
@given(data=st.data())
def test_a_damaged_command_message_is_run_or_rejected_with_one_protocol_error(comm, data):
    worker = Worker(0, Replies(), comm, CpuDevice(), start_seq=0)
    deliver(worker, wire.encode_batch(0, [wire.DefineMesh(0, 0, "cpu", (1,), (0,))]))
    worker.next_seq = 0   # the damaged batch below starts at seq 0 again
    message = data.draw(st.sampled_from(messages()))
    try:
        deliver(worker, data.draw(damaged(message, at=1)))
    except ProtocolError:
        return   # the real worker reports this and stops: one clear error
    for reply in worker.sockets.sent:   # whatever it answered is well formed
        wire.read_header(reply[0])
    if worker.shards.member(0) is None:   # mesh 0 lost, or redefined without this rank
        deliver(worker, wire.encode_batch(worker.next_seq, [wire.DefineMesh(worker.next_seq, 0, "cpu", (1,), (0,))]))
    still_works(worker)


def test_memory_stayed_bounded_through_the_fuzz():
    """Runs after the fuzz in this module: claimed multi-GB lengths allocated nothing."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak_mib < 2048, f"peak RSS {peak_mib:.0f} MiB"
