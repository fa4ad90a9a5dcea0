"""Complex tensors on real workers, against plain torch: every redistribute on complex64 (and
complex128), moves between meshes, ops on complex shards, reads. Collectives carry a complex
tensor as its real view (comm.real_view); what has no meaning for complex numbers, P(max) and
P(min), is refused at the call (docs/reference/ops.md, "Complex tensors")."""
import contextlib
import itertools

import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.errors import PlacementError, ShapeError, UnsupportedOpError
from dtorch.runtime.devices import comm, nccl
from support import placed

R = Replicate()
CHOICES = [R, Shard(0), Shard(1), Partial()]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def values(shape, dtype=torch.complex64, seed=0) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def split_sum(value, parts, reduce_op, g):
    """Random complex contributions that sum to `value` (simulate.split_partial draws real ones)."""
    pieces = [torch.randn(value.shape, dtype=value.dtype, generator=g) for _ in range(parts - 1)]
    return pieces + [value - sum(pieces, torch.zeros_like(value))]


def upload(value, mesh, placements):
    """`value` as `placements`; a P(sum) dim holds random contributions, not the value and zeros."""
    return placed(value, mesh, placements, torch.Generator().manual_seed(1), split_sum)


@pytest.mark.parametrize("shape", [(8, 12), (7, 5), (3, 2)])
def test_every_pair_on_a_1d_mesh(mesh4, shape):
    value = values(shape)
    for src, dst in itertools.product(CHOICES, repeat=2):
        moved = upload(value, mesh4, [src]).redistribute(placements=[dst])
        assert moved.placements == (dst,)
        assert_close(moved.to_torch(), value)


def test_every_pair_in_complex128(mesh4):
    """Made on the workers, moved every way, read from one rank (R)."""
    value = values((7, 5))
    wide = dtorch.tensor(value, device_mesh=mesh4, placements=[R]).to(torch.complex128)
    for src, dst in itertools.product(CHOICES, repeat=2):
        moved = wide.redistribute(placements=[src]).redistribute(placements=[dst])
        assert moved.placements == (dst,)
        assert_close(moved.redistribute(placements=[R]).to_torch(), value.to(torch.complex128))


def test_every_pair_on_a_2d_mesh(mesh22):
    value = values((5, 7))
    layouts = list(itertools.product(CHOICES, repeat=2))
    for src, dst in itertools.product(layouts, repeat=2):
        assert_close(upload(value, mesh22, src).redistribute(placements=dst).to_torch(), value)


def test_partial_avg_reduces_as_a_complex_mean(mesh22):
    """Every rank holds the value under P(avg): the sum of the real views over n ranks, over n."""
    value = values((6, 5))
    for dst in ([R, R], [Shard(0), R], [R, Shard(1)]):
        x = dtorch.tensor(value, device_mesh=mesh22, placements=[Partial("avg"), Partial("avg")])
        assert_close(x.redistribute(placements=dst).to_torch(), value)


def test_moves_between_meshes(mesh4, mesh22, mesh1):
    value = values((7, 6))
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)])
    for mesh, placements in [(mesh22, [Shard(1), Shard(0)]), (mesh1, [R]), (mesh22, [Partial(), R])]:
        assert_close(x.redistribute(device_mesh=mesh, placements=placements).to_torch(), value)


# Ops on complex shards, each on placements that need no collective, a Partial result, and moves
# dtorch inserts; compared with torch on the whole tensors.
A, B, W = values((8, 6), seed=2), values((8, 6), seed=3), values((6, 5), seed=4)
OPS = {
    "add": lambda a, b, w: a + b, "sub": lambda a, b, w: a - 2 * b, "mul": lambda a, b, w: a * b,
    "div": lambda a, b, w: a / (b + 3), "matmul": lambda a, b, w: a @ w,
    "linear": lambda a, b, w: torch.nn.functional.linear(a, w.t()),
    "einsum": lambda a, b, w: torch.einsum("ij,jk->ik", a, w),
    "bmm": lambda a, b, w: torch.bmm(a.reshape(2, 4, 6), w.expand(2, 6, 5)),
    "sum": lambda a, b, w: a.sum(), "sum(0)": lambda a, b, w: a.sum(0), "mean": lambda a, b, w: a.mean(),
    "mean(1)": lambda a, b, w: a.mean(1), "var(0)": lambda a, b, w: a.var(0), "cumsum": lambda a, b, w: a.cumsum(0),
    "vdot": lambda a, b, w: torch.vdot(a.flatten(), b.flatten()), "abs": lambda a, b, w: a.abs(),
    "exp": lambda a, b, w: a.exp(), "sgn": lambda a, b, w: a.sgn(), "reshape": lambda a, b, w: a.reshape(4, 12),
    "cat": lambda a, b, w: torch.cat([a, b], 1), "index": lambda a, b, w: a[1:7, ::2],
    "by a tensor": lambda a, b, w: a * torch.tensor(1 + 2j),
    "to complex128": lambda a, b, w: a.to(torch.complex128).sum(),   # (read from one rank: see above)
}
LAYOUTS = [(Shard(0), Shard(0), R), (Shard(1), Shard(1), Shard(0)), (R, Shard(0), Shard(1))]


@pytest.mark.parametrize("name", OPS)
def test_op_matches_torch(mesh4, mesh22, name, automatic):
    op = OPS[name]
    expected = op(A, B, W)
    for (pa, pb, pw), mesh in itertools.product(LAYOUTS, (mesh4, mesh22)):
        a, b, w = (dtorch.tensor(v, device_mesh=mesh, placements=[p] + [R] * (mesh.ndim - 1))
                   for v, p in ((A, pa), (B, pb), (W, pw)))
        assert_close(op(a, b, w).to_torch(), expected)


def test_backward_through_complex_collectives(mesh4):
    """The gradient of a real loss of complex shards: backward runs each step's dual collective."""
    value = values((8, 6))
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True)
    (x.redistribute(placements=[R]) * torch.tensor(2 - 1j)).abs().sum().backward()
    reference = value.clone().requires_grad_()
    (reference * torch.tensor(2 - 1j)).abs().sum().backward()
    assert_close(x.grad.to_torch(), reference.grad)


# --- refused at the call, before anything is sent ----------------------------------------------
def test_partial_max_or_min_of_complex_values_is_refused(mesh22):
    value = values((4, 6))
    with pytest.raises(PlacementError, match=r"complex64 tensor cannot be \[P\(max\), R\].*no order"):
        dtorch.tensor(value, device_mesh=mesh22, placements=[Partial("max"), R])
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), R])
    with pytest.raises(PlacementError) as info:
        x.redistribute(placements=[Shard(0), Partial("min")])
    for expected in ("[S(0), P(min)]", "DeviceMesh", "test_complex.py", "P(sum) and P(avg)"):
        assert expected in str(info.value), (expected, str(info.value))
    assert_close(x.to_torch(), value)   # nothing reached the workers


def test_ordering_ops_are_refused_as_torch_refuses_them(mesh4):
    x = dtorch.tensor(values((8, 6)), device_mesh=mesh4, placements=[Shard(0)])
    for call in (lambda: x.amax(), lambda: torch.max(x, 0), lambda: x.argmin(1),
                 lambda: x.redistribute(placements=[R]).median()):
        with pytest.raises(ShapeError, match="not implemented for 'ComplexFloat'|does not support complex"):
            call()
    assert_close(x.abs().amax().to_torch(), values((8, 6)).abs().amax())


def test_a_python_complex_scalar_is_refused_and_the_session_goes_on(mesh4):
    x = dtorch.tensor(values((8, 6)), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(UnsupportedOpError, match=r"complex scalar \(1\+2j\).*torch.tensor\(\(1\+2j\)\)"):
        x * (1 + 2j)
    assert_close((x + x).to_torch(), 2 * values((8, 6)))


# --- the communicators, by construction --------------------------------------------------------
def test_reductions_take_the_real_view_in_the_same_memory():
    tensor = values((3, 4))
    for reduce_op in ("sum", "avg"):
        real = comm.reducible(tensor, reduce_op)
        assert real.dtype == torch.float32 and real.shape == (3, 4, 2) and real.data_ptr() == tensor.data_ptr()
    for reduce_op in ("max", "min"):
        with pytest.raises(TypeError, match="no order"):
            comm.reducible(tensor, reduce_op)
    assert comm.reducible(torch.ones(3), "max").dtype == torch.float32


class _RecordingNccl:
    """cupy's communicator as the calls see it: records (function, count, datatype, op)."""
    def __init__(self):
        self.calls = []

    def allReduce(self, send, receive, count, datatype, op, stream):
        self.calls.append(("allReduce", count, datatype, op))

    def reduceScatter(self, send, receive, count, datatype, op, stream):
        self.calls.append(("reduceScatter", count, datatype, op))


def test_nccl_reduces_complex_tensors_as_their_real_views():
    """No GPU here: NcclCommunicator's reductions, with cupy's communicator and the CUDA stream
    stood in for, pass NCCL twice the elements as float32 / float64, and refuse max and min."""
    communicator, recorded = object.__new__(nccl.NcclCommunicator), _RecordingNccl()

    @contextlib.contextmanager
    def enqueue(ranks):
        yield recorded, 0
    communicator.single_rank, communicator._enqueue = False, enqueue
    communicator.all_reduce((0, 1), values((3, 4)), "avg")
    communicator.reduce_scatter((0, 1), values((2, 5), torch.complex128), "sum")
    assert recorded.calls == [("allReduce", 24, nccl.NCCL_DATATYPES[torch.float32], nccl.NCCL_REDUCE_OPS["sum"]),
                              ("reduceScatter", 10, nccl.NCCL_DATATYPES[torch.float64], nccl.NCCL_REDUCE_OPS["sum"])]
    with pytest.raises(TypeError, match="no order"):
        communicator.all_reduce((0, 1), values((3, 4)), "max")


def test_a_value_the_wire_cannot_carry_fails_its_command_not_the_session(mesh4):
    """dtorch.full with a Python complex fill value: msgpack cannot encode it. The command keeps
    its seq as an empty stand-in (a gap in the numbering would end the session), and fails at the
    read naming the user's line; everything else goes on."""
    filled = dtorch.full((4, 4), 1 + 2j, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.RemoteError, match=r"(?s)test_complex.py:\d+.*cannot send this command"):
        filled.to_torch()
    x = dtorch.ones(4, 4, dtype=torch.complex64, device_mesh=mesh4, placements=[Shard(0)])
    assert_close((x * 2).to_torch(), torch.full((4, 4), 2 + 0j))
    dtorch.synchronize()


def test_complex128_uploads_and_sharded_reads_on_any_frame_alignment(mesh4):
    """Frames ZeroMQ hands over need not sit on complex128's 16-byte alignment: they are copied
    then, not viewed (a misaligned complex128 view crashed the worker, or the controller)."""
    for rows in (5, 6, 7, 9):
        value = values((rows, 3), torch.complex128, seed=rows)
        x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)])
        assert_close((x * 2).to_torch(), value * 2)
