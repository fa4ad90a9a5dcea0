"""A read's result from its reply's bytes (reads.FetchRead), made the two ways a read can take:
prepared while the reply is on its way (FetchRead.prepare, then the bytes copied in), and built
from the reply when it came before prepare ran (another thread handled it). Both must give
torch's tensor exactly: values, dtype, shape."""
from __future__ import annotations

import pytest
import torch
import zmq

from dtorch.spec.placements import DeviceMesh, Replicate, Shard
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.runtime.controller import reads
from dtorch.runtime.controller.reads import FetchRead, Future

ONE_RANK = DeviceMesh("cpu", [0])
TWO_RANKS = DeviceMesh("cpu", [0, 1])

CASES = [
    torch.arange(6.0).reshape(2, 3),
    torch.tensor(7, dtype=torch.int64),                    # 0-dim
    torch.empty(0, 3),                                     # no bytes: the reply carries an empty frame
    torch.tensor([True, False, True]),
    torch.arange(4.0).to(torch.bfloat16),
    torch.arange(6.0, dtype=torch.float64).reshape(3, 2) * 1.5,
    torch.arange(20_000.0),                                # above PREPARED_READ_BYTES: never prepared
]


def _finished(values: torch.Tensor, mesh: DeviceMesh, placements, prepared: bool) -> torch.Tensor:
    meta = tensor_meta(tuple(values.shape), values.dtype, mesh, placements)
    senders = meta.senders()
    read = FetchRead(mesh.ranks, Future(), meta, senders, produced_seq=1)
    if prepared:
        read.prepare()
    for rank in mesh.ranks:
        piece = values.chunk(len(mesh.ranks))[rank] if placements[0] == Shard(0) else values
        frames = [zmq.Frame(piece.contiguous().view(-1).view(torch.uint8).numpy().tobytes())] if rank in senders else []
        assert read.check(rank, "ok", frames) is None
        read.add(rank, "ok", -1, frames)
    assert read.finish({}) is True
    return read.future.result(timeout=0)


@pytest.mark.parametrize("values", CASES, ids=lambda v: f"{v.dtype}{tuple(v.shape)}")
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "reply first"])
def test_a_read_gives_torchs_tensor_either_way(values, prepared):
    result = _finished(values, ONE_RANK, [Replicate()], prepared)
    assert result.dtype == values.dtype and result.shape == values.shape
    assert torch.equal(result, values)


def test_only_a_small_read_from_one_rank_is_prepared():
    small = tensor_meta((4,), torch.float32, TWO_RANKS, (Replicate(),))
    read = FetchRead(TWO_RANKS.ranks, Future(), small, small.senders(), 1)
    read.prepare()
    assert read.prepared is not None and read.prepared.shape == (4,)
    sharded = tensor_meta((4,), torch.float32, TWO_RANKS, (Shard(0),))   # two senders: assembled from pieces
    read = FetchRead(TWO_RANKS.ranks, Future(), sharded, sharded.senders(), 1)
    read.prepare()
    assert read.prepared is None
    large = tensor_meta((reads.PREPARED_READ_BYTES // 4 + 1,), torch.float32, ONE_RANK, (Replicate(),))
    read = FetchRead(ONE_RANK.ranks, Future(), large, large.senders(), 1)
    read.prepare()
    assert read.prepared is None


def test_a_sharded_read_is_assembled_from_every_rank():
    values = torch.arange(10.0).reshape(5, 2)   # uneven: 3 rows and 2
    result = _finished(values, TWO_RANKS, [Shard(0)], prepared=True)
    assert torch.equal(result, values)
