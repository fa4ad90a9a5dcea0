"""Fuzzing the controller's reply socket in-process: a real Controller (its loop thread, its ipc
ROUTER) with two stand-in workers that register with the run's secret from DEALERs, and forgers
that send damaged REGISTER / REPLY / ERROR / HEARTBEAT messages — from identities of their own,
from the stand-ins' identities after they answered (duplicates, unknown seqs), and claiming huge
lengths. Properties: nothing crashes or hangs, every read returns exactly what the stand-ins
sent, a wrong byte count from a registered worker fails the read with one ProtocolError, and
every rejected message is counted."""
import logging
import os

import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st

from dtorch.spec.placements import DeviceMesh, Shard
from dtorch.errors import ProtocolError
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.runtime import protocol as wire
from dtorch.runtime.controller import cluster as cluster_module
from dtorch.runtime.controller.controller import Controller
from dtorch.runtime.controller.reads import FetchRead, Future
from fuzzing import damaged, fuzz_settings

pytestmark = pytest.mark.timeout(300)
MESH = DeviceMesh("cpu", [0, 1])
READ_TIMEOUT_S = 10


class StandIn:
    """A worker handle for the controller's bookkeeping: the process is this test."""
    host = "localhost"

    def __init__(self, rank):
        self.rank, self.pid = rank, os.getpid()

    def poll(self):
        return None

    def wait(self, timeout=None):
        return 0

    def kill(self):
        pass


class Harness:
    def __init__(self):
        self.controller = Controller()
        self.context = zmq.Context()
        self.controller.add_workers([StandIn(0), StandIn(1)], "cpu")
        self.workers = [self.dealer(b"w%d:standin" % rank) for rank in (0, 1)]
        for rank, dealer in enumerate(self.workers):
            dealer.send_multipart([wire.encode(wire.Register(rank, "here", os.getpid(), "cpu",
                                                             self.controller.secret, 1))])
            assert wire.read_header(dealer.recv_multipart()[0])[1] == wire.Kind.WELCOME
        self.forgers = [self.dealer(b"w0"), self.dealer(b"w1:guess"), self.dealer(b"h0"), self.dealer(b"")]
        self.mesh_id = self.controller.define_mesh(MESH)
        # Every seq of this run packs to the same width, so that hypothesis's draws (which cut
        # frames at drawn offsets) never depend on which seq an example happens to get.
        with self.controller._lock:
            self.controller._pending = []
            self.controller._next_seq = 1 << 20

    def dealer(self, identity: bytes):
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, READ_TIMEOUT_S * 1000)
        if identity:
            socket.setsockopt(zmq.IDENTITY, identity)
        socket.connect(self.controller.sockets.reply_address)
        return socket

    def start_read(self, values: torch.Tensor):
        spec = tensor_meta(tuple(values.shape), values.dtype, MESH, (Shard(0),))
        future = Future()
        read = FetchRead(MESH.ranks, future, spec, (0, 1), 0)
        seq = self.controller.submit(wire.Fetch, self.controller.new_id(), self.mesh_id, (0, 1), read=read)
        return seq, future

    def answer(self, seq: int, values: torch.Tensor, rank: int, payload=None) -> None:
        shard = values.chunk(2)[rank].contiguous()
        data = shard.numpy().tobytes() if payload is None else payload
        self.workers[rank].send_multipart([wire.encode(wire.Reply(seq, rank, "ok", -1)), data])

    def close(self):
        self.context.destroy(linger=0)
        self.controller.shutdown(timeout=1)


@pytest.fixture(scope="module")
def harness():
    logging.getLogger("dtorch.controller").setLevel(logging.ERROR)   # thousands of expected drops
    silence, cluster_module.WORKER_SILENCE_S = cluster_module.WORKER_SILENCE_S, 1e9  # no heartbeats here
    harness = Harness()
    yield harness
    harness.close()
    cluster_module.WORKER_SILENCE_S = silence
    logging.getLogger("dtorch.controller").setLevel(logging.NOTSET)


def valid_messages(seq: int, secret: str) -> list:
    return [[wire.encode(wire.Reply(seq, 0, "ok", -1)), b"\0" * 16],
            [wire.encode(wire.Reply(seq, 1, "poisoned", 3))],
            [wire.encode(wire.ErrorReport(seq, 1, "add", "ValueError", "forged", ""))],
            [wire.encode(wire.ErrorReport(seq, 0, wire.PROTOCOL_FAILURE, "ProtocolError", "forged", ""))],
            [wire.encode(wire.Register(0, "evil", 1, "cpu", secret, 1))],
            [wire.encode(wire.Heartbeat(0, 0, 0, -1, 0.0))]]


EXAMPLES = fuzz_settings(1200)


@EXAMPLES
@given(data=st.data())
def test_forged_and_damaged_messages_never_change_a_read(harness, data):
    values = torch.arange(8.0) + data.draw(st.integers(0, 1000))
    seq, future = harness.start_read(values)
    rejected = harness.controller.stats()["messages_rejected"]
    # A forger may know the seq, but not the secret: "guessed" stands in for it.
    forged = data.draw(damaged(data.draw(st.sampled_from(valid_messages(seq, "guessed")))))
    sender = data.draw(st.sampled_from(harness.forgers))
    send(sender, forged)
    harness.answer(seq, values, 0)
    harness.answer(seq, values, 1)
    # From a registered worker after it answered: a REPLY is never owed (an ERROR from it would
    # be the worker's own word, e.g. that its stream broke, which the controller must believe).
    replayed = data.draw(damaged(data.draw(st.sampled_from(valid_messages(seq, "guessed")[:2]))))
    if replayed and not _is_error(replayed[0]):
        send(harness.workers[data.draw(st.integers(0, 1))], replayed)
    assert torch.equal(future.result(READ_TIMEOUT_S), values)
    sync(harness)
    assert harness.controller.stats()["messages_rejected"] > rejected or not forged
    assert all(w.lost is None for w in harness.controller.workers.values())


def _is_error(header: bytes) -> bool:
    try:
        return wire.unpack(header)[1] == wire.Kind.ERROR
    except Exception:
        return False


def send(socket, frames):
    if frames:
        socket.send_multipart(frames)


def sync(harness):
    """Everything sent so far has been handled: a read that completes after it."""
    values = torch.zeros(2)
    seq, future = harness.start_read(values)
    harness.answer(seq, values, 0)
    harness.answer(seq, values, 1)
    future.result(READ_TIMEOUT_S)


@pytest.mark.parametrize("payload", [b"", b"\0" * 15, b"\0" * 17, b"\0" * 4096])
def test_a_wrong_byte_count_fails_the_read_with_a_protocol_error(harness, payload):
    values = torch.arange(8.0)
    seq, future = harness.start_read(values)
    harness.answer(seq, values, 0, payload=payload)
    harness.answer(seq, values, 1)
    with pytest.raises(ProtocolError, match="bytes"):
        future.result(READ_TIMEOUT_S)
    sync(harness)   # the session goes on


def test_duplicates_and_unknown_seqs_are_counted_and_change_nothing(harness):
    values = torch.arange(8.0)
    seq, future = harness.start_read(values)
    before = harness.controller.stats()["messages_rejected"]
    harness.answer(seq, values, 0)
    harness.answer(seq, values * 0 - 1, 0)             # a second answer from rank 0
    harness.answer(seq + 1000, values, 1)              # a seq nobody asked for
    harness.answer(seq, values, 1)
    assert torch.equal(future.result(READ_TIMEOUT_S), values)
    harness.answer(seq, values * 0 - 1, 1)             # after the read completed
    sync(harness)
    assert harness.controller.stats()["messages_rejected"] - before == 3


def test_a_multi_gigabyte_length_claim_allocates_nothing(harness):
    rss_before = _rss_mib()
    for claim in (b"\xc6\xff\xff\xff\xf0", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        for forger in harness.forgers:
            forger.send_multipart([claim + b"\x01" * 32])
    sync(harness)
    assert _rss_mib() - rss_before < 64


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
