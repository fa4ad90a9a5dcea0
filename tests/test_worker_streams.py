"""The worker's side of compute/communication overlap, in one process on CPU.

On a GPU, CudaDevice.communicate runs a redistribute on the communication stream and returns an
event; the compute stream must wait on that event before any later command reads the result, and
only then (so independent compute overlaps). This test drives a real Worker (real Gloo, one rank)
with a device that runs like the CPU one but hands out numbered events and logs every wait, and
checks that contract: who waits, when, on which event, and that freed or failed tensors leave no
event behind. It checks the bookkeeping only; what runs on a GPU is tests/test_cuda.py.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.spec.redistribute import plan_redistribute
from dtorch.runtime import protocol as wire
from dtorch.runtime.devices.comm import GlooCommunicator
from dtorch.runtime.devices.device import CpuDevice
from dtorch.runtime.worker.worker import Worker


class LoggingDevice(CpuDevice):
    """CpuDevice whose communications finish "later": each returns a fresh event number."""

    def __init__(self):
        super().__init__()
        self.events = itertools.count(1)
        self.log: list = []

    def communicate(self, work, inputs):
        result = work()
        event = next(self.events)
        self.log.append(("communicate", event))
        return result, event

    def wait(self, done, tensor):
        self.log.append(("wait", done))

    def to_host(self, tensor):
        self.log.append(("to_host",))
        return super().to_host(tensor)

    def small_bytes(self, tensor):
        return None   # as on CUDA: every read goes through to_host


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(wire.read_header(frames[0]))


@pytest.fixture
def worker():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    comm = GlooCommunicator(f"127.0.0.1:{store.port}", 0, "127.0.0.1", 30.0)
    worker = Worker(0, Replies(), comm, LoggingDevice(), start_seq=0)
    seq = itertools.count()
    worker.issue = lambda cls, *fields: worker._execute(cls(next(seq), *fields))
    worker.issue(wire.DefineMesh, 0, "cpu", (1,), (0,))
    yield worker
    comm.close()


def make(worker, tensor_id, placements=(Shard(0),)):
    worker.issue(wire.Factory, tensor_id, 0, "arange", (6,), "float32", placements, (0.0, 1.0))


def redistribute(worker, out_id, src_id, before, after):
    worker.issue(wire.Redistribute, out_id, src_id, 0, (6,), "float32", before,
                       tuple(plan_redistribute(before, after)))


def add(worker, out_id, a, b):
    worker.issue(wire.RunOp, (out_id,), 0, "add", "add", (wire.TensorRef(a), wire.TensorRef(b)), {}, ())


def test_compute_waits_for_a_communication_only_when_it_reads_the_result(worker):
    make(worker, 1, (Partial(),))
    redistribute(worker, 2, 1, (Partial(),), (Replicate(),))      # all_reduce: communication
    assert worker.device.log == [("communicate", 1)] and set(worker.in_flight) == {2}
    make(worker, 3)
    add(worker, 4, 3, 3)                                              # independent compute: no wait
    assert worker.device.log == [("communicate", 1)]
    add(worker, 5, 2, 3)                                              # reads the result: waits once
    add(worker, 6, 2, 2)
    assert worker.device.log == [("communicate", 1), ("wait", 1)] and not worker.in_flight
    assert torch.equal(worker.tensors[5], torch.arange(6.0) * 2)


def test_a_communication_reading_one_in_flight_does_not_make_compute_wait(worker):
    make(worker, 1, (Partial(),))
    redistribute(worker, 2, 1, (Partial(),), (Shard(0),))            # reduce_scatter
    redistribute(worker, 3, 2, (Shard(0),), (Replicate(),))          # all_gather of an in-flight one
    assert worker.device.log == [("communicate", 1), ("communicate", 2)]
    assert worker.in_flight == {2: 1, 3: 2}
    add(worker, 4, 3, 2)
    assert worker.device.log[2:] == [("wait", 2), ("wait", 1)]
    assert torch.equal(worker.tensors[4], torch.arange(6.0) * 2)


def test_local_only_redistributes_stay_on_the_compute_stream(worker):
    make(worker, 1, (Replicate(),))
    redistribute(worker, 2, 1, (Replicate(),), (Shard(0),))          # a slice
    redistribute(worker, 3, 2, (Shard(0),), (Shard(0),))             # nothing to do
    assert worker.device.log == [] and not worker.in_flight


def test_a_read_waits_before_its_device_to_host_copy(worker):
    make(worker, 1, (Partial(),))
    redistribute(worker, 2, 1, (Partial(),), (Replicate(),))
    worker.issue(wire.Fetch, 2, 0, (0,))
    assert worker.device.log == [("communicate", 1), ("wait", 1), ("to_host",)]
    assert worker.sockets.sent[-1][1] == wire.Kind.REPLY


def test_freed_and_failed_tensors_leave_no_event_behind(worker):
    make(worker, 1, (Partial(),))
    redistribute(worker, 2, 1, (Partial(),), (Replicate(),))
    worker.issue(wire.Free, (2,))
    assert not worker.in_flight
    redistribute(worker, 3, 99, (Partial(),), (Replicate(),))        # no tensor 99: fails
    assert 3 in worker.shards.poisoned and not worker.in_flight
    assert worker.sockets.sent[-1][1] == wire.Kind.ERROR


class FrameLog:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(frames)


@pytest.mark.parametrize("tensor, at_once", [
    (torch.arange(6.0), True),
    (torch.tensor(3, dtype=torch.int64), True),                    # 0-dim
    (torch.arange(12.0).reshape(3, 4).t(), True),                  # not contiguous: bytes in row-major order
    (torch.ones(3, dtype=torch.bool), True),
    (torch.arange(4.0).to(torch.bfloat16), True),                  # contiguous: its bytes, whatever the dtype
    (torch.arange(8.0).to(torch.bfloat16)[::2], False),            # strided, and numpy lacks bfloat16
    (torch.arange(-3.0, 3.0)[1:5], True),                          # a view with a storage offset
    (torch.arange(20_000.0), False),                               # 80 KB: a snapshot that leaves zero-copy
])
def test_a_cpu_read_of_a_small_tensor_sends_its_bytes_at_once(tensor, at_once):
    logged = []

    class Device(CpuDevice):
        def to_host(self, t):
            logged.append("to_host")
            return super().to_host(t)

    replies = FrameLog()
    worker = Worker(0, replies, None, Device(), start_seq=0)
    worker._execute(wire.DefineMesh(0, 0, "cpu", (1,), (0,)))
    worker.tensors[5] = tensor
    worker._execute(wire.Fetch(1, 5, 0, (0,)))
    (frames,) = replies.sent
    assert wire.read_header(frames[0])[1] == wire.Kind.REPLY
    expected = tensor.contiguous().view(-1).view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
    assert bytes(frames[1]) == bytes(expected.numpy())
    assert logged == ([] if at_once else ["to_host"])
