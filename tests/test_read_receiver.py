"""Who takes a read's reply off the controller's socket. A thread that blocks on a read receives
its reply itself (Controller.receive_here), so the controller's loop thread stops watching the
socket; these tests check that everything that does not block on a read still gets its replies
afterwards: awaited and polled futures, reads slower than the reading thread's wait, other
threads' reads, and the workers' heartbeats."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dtorch.errors import RemoteError
from dtorch.runtime.controller import cluster
from dtorch.runtime.controller import reply_receiving
from dtorch.runtime.controller import session


def _blocking_reads(mesh, count: int = 3) -> None:
    """Blocking reads: afterwards the loop thread has handed the socket to the reading thread."""
    for i in range(count):
        assert ((dtorch.full((4,), float(i), device_mesh=mesh, placements=[Shard(0)]) + 1).to_torch().tolist()
                == [i + 1.0] * 4)


@pytest.fixture
def loop_held(monkeypatch):
    """The controller's loop thread held in a callback, for the test's length: each blocking read
    publishes its command and receives its replies on its own thread (for as long as the read's
    timeout here, so that workers slow to answer on a busy machine cannot hand the read back to
    the held loop), and no watchdog tick takes the socket between two reads."""
    monkeypatch.setattr(reply_receiving, "READER_RECEIVE_S", 60.0)
    dtorch.synchronize()   # nothing earlier still runs on the workers
    loop = session.controller()._loop
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(60)
    loop.call_soon_threadsafe(hold)
    assert held.wait(30)
    try:
        yield
    finally:
        release.set()


def test_a_blocking_read_needs_no_loop_thread(mesh4, loop_held):
    x = dtorch.arange(10, device_mesh=mesh4, placements=[Shard(0)]) * 3
    assert torch.equal(x.fetch().result(timeout=30), torch.arange(10) * 3)
    dtorch.synchronize(timeout=30)


def test_an_awaited_read_after_blocking_reads(mesh4):
    _blocking_reads(mesh4)
    x = dtorch.ones(6, 2, device_mesh=mesh4, placements=[Shard(0)]) * 5

    async def read():
        return await x.fetch()
    assert torch.equal(asyncio.run(asyncio.wait_for(read(), 30)), torch.full((6, 2), 5.0))


def test_a_polled_future_after_blocking_reads(mesh4):
    _blocking_reads(mesh4)
    future = (dtorch.ones(3, device_mesh=mesh4, placements=[Replicate()]) * 2).fetch()
    deadline = time.monotonic() + 30
    while not future.done():
        assert time.monotonic() < deadline, "a polled read never completed"
        time.sleep(0.001)
    assert torch.equal(future.result(), torch.full((3,), 2.0))


def test_reads_slower_than_the_reading_threads_wait(mesh4, monkeypatch):
    """The reading thread gives up at once: the loop thread must take the replies over."""
    monkeypatch.setattr(reply_receiving, "READER_RECEIVE_S", 0.0)
    _blocking_reads(mesh4)
    x = dtorch.ones(64, 64, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(20):
        x = (x @ dtorch.ones(64, 64, device_mesh=mesh4, placements=[Replicate()])) / 64
    assert torch.allclose(x.to_torch(), torch.ones(64, 64))


def test_a_read_on_one_thread_while_another_holds_the_socket(mesh4):
    """Two threads read at once: the one that does not hold the socket is answered by the one
    that does, or by the loop thread once it lets go."""
    errors, results = [], {}

    def read(index):
        try:
            for i in range(30):
                value = (dtorch.full((8,), float(i), device_mesh=mesh4, placements=[Shard(0)]) * index).to_torch()
                assert torch.equal(value, torch.full((8,), float(i * index)))
            results[index] = True
        except BaseException as error:   # reported below
            errors.append(error)
    threads = [threading.Thread(target=read, args=(i,)) for i in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert sorted(results) == [1, 2, 3]


def test_heartbeats_are_taken_while_only_blocking_reads_run(mesh4):
    """The loop thread does not watch the socket after blocking reads; its watchdog still drains
    the heartbeats, so a quiet spell longer than the silence limit loses no worker."""
    _blocking_reads(mesh4)
    time.sleep(cluster.WORKER_SILENCE_S + 1.0)
    x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)]) + 1
    assert torch.equal(x.to_torch(), torch.full((4,), 2.0))
    assert all(w.lost is None for w in session.controller().workers.values())


@pytest.mark.timeout(60)
def test_a_remote_error_reaches_a_blocking_read(mesh4):
    """The failure record and the poisoned replies are handled on the reading thread."""
    _blocking_reads(mesh4)
    numerator = dtorch.tensor(torch.arange(8), device_mesh=mesh4, placements=[Shard(0)])
    denominator = dtorch.tensor(torch.tensor([1, 1, 1, 1, 1, 1, 0, 1]), device_mesh=mesh4, placements=[Shard(0)])
    quotient = dtorch.div(numerator, denominator, rounding_mode="floor")   # fails on rank 3
    with pytest.raises(RemoteError, match="div") as raised:
        quotient.to_torch()
    assert raised.value.ranks == [3]
    _blocking_reads(mesh4)   # the session goes on


def _spun(read) -> tuple:
    """(the value `read()` returns, how many blocking reads spun meanwhile)."""
    before = dtorch.stats()["reads_spun"]
    value = read()
    return value, dtorch.stats()["reads_spun"] - before


def test_a_read_spins_while_the_workers_are_idle(mesh4, loop_held, monkeypatch):
    """READ_SPIN_S's first rule. With a spin too short for any reply to beat, only idleness makes
    a read spin: one issued right after synchronize() does, one issued after work does not (nor
    does the synchronize, which waits for that work). Both read the right values. The loop thread
    is held: a read that finds the socket taken (by the watchdog's tick) leaves it to the loop and
    neither spins nor counts its wait, which would make the counts here a matter of timing."""
    monkeypatch.setattr(reply_receiving, "READ_SPIN_S", 1e-9)
    _blocking_reads(mesh4, 1)   # its wait outlasts the spin: "the last wait was short" is off
    x = dtorch.arange(8., device_mesh=mesh4, placements=[Shard(0)]) * 2
    value, spun = _spun(x.to_torch)
    assert torch.equal(value, torch.arange(8.) * 2) and spun == 0
    y = x + 1
    _, spun = _spun(dtorch.synchronize)
    assert spun == 0
    value, spun = _spun(y.to_torch)
    assert torch.equal(value, torch.arange(8.) * 2 + 1) and spun == 1
    value, spun = _spun(y.to_torch)   # read after read: still idle
    assert torch.equal(value, torch.arange(8.) * 2 + 1) and spun == 1


def test_a_read_spins_after_two_short_waits(mesh4, loop_held, monkeypatch):
    """READ_SPIN_S's second rule: after two reads in a row whose replies came within the spin,
    the next read spins even though work came before it; after one that waited longer, it does
    not, even if the read between was short (a step that logs its loss, then an idle read).
    Its tensors span every worker, so that a read of one tells that they are all idle. The loop
    thread is held, as in the test above."""
    everyone = init_device_mesh("cpu", (len(dtorch.workers()),))
    matrix = dtorch.ones(4, 4, device_mesh=everyone, placements=[Replicate()])
    monkeypatch.setattr(reply_receiving, "READ_SPIN_S", 1e-9)
    _blocking_reads(mesh4, 1)   # outlasts the spin: no short wait in a row
    monkeypatch.setattr(reply_receiving, "READ_SPIN_S", 60.0)
    _blocking_reads(mesh4, 1)   # answered within a minute: one short wait
    x = dtorch.ones(4, 4, device_mesh=everyone, placements=[Shard(0)]) @ matrix
    value, spun = _spun(x.to_torch)   # work came first, and one short wait is not enough
    assert torch.equal(value, torch.full((4, 4), 4.0)) and spun == 0
    value, spun = _spun((x + 1).to_torch)   # two short waits in a row now
    assert torch.equal(value, torch.full((4, 4), 5.0)) and spun == 1
    monkeypatch.setattr(reply_receiving, "READ_SPIN_S", 1e-9)
    _blocking_reads(mesh4, 1)   # spun, and outlasted the new spin: the run of short waits ends
    y = x @ matrix
    _, spun = _spun(y.to_torch)   # the "loss": not idle, no short waits: sleeps, and waits long
    assert spun == 0
    monkeypatch.setattr(reply_receiving, "READ_SPIN_S", 60.0)
    value, spun = _spun(y.to_torch)   # the "norm": idle, so it spins; one short wait in a row
    assert torch.equal(value, torch.full((4, 4), 16.0)) and spun == 1
    _, spun = _spun((y * 2).to_torch)   # the next step's "loss": one short wait is not enough
    assert spun == 0
