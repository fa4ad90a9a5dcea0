"""torch functions that dtorch composes from its ops (dtorch/torch_api/compositions.py), each against torch on the
same values: sharded on the first or last dim, replicated, on (4,) and (2, 2), with even and uneven
shapes, and the gradient of every floating-point input."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard

pytestmark = pytest.mark.timeout(600)

FIRST, LAST = 0, -1
LAYOUTS = {"mesh4": [[FIRST], [LAST], [None]], "mesh22": [[FIRST, LAST], [LAST, None]]}


def _placement(dim, value: torch.Tensor):
    """Shard on the first or last dim where the value has one, else Replicate."""
    if dim is None or value.ndim == 0:
        return Replicate()
    return Shard(dim % value.ndim)


def _sizes(uneven: bool):
    return (7, 5, 3) if uneven else (8, 4, 4)


def _floats(*shapes):
    return lambda g, uneven: [torch.randn(shape(*_sizes(uneven)), generator=g) for shape in shapes]


def _signs(n):
    return lambda g, uneven: torch.randint(0, 2, (n(*_sizes(uneven)),), generator=g).float() * 2 - 1


def _with(make, *more):
    """Inputs of `make`, then each of `more` (g, uneven) -> one more tensor."""
    return lambda g, uneven: make(g, uneven) + [m(g, uneven) for m in more]


MATRIX, ROW, COLUMN = (lambda n, d, k: (n, d)), (lambda n, d, k: (d,)), (lambda n, d, k: (n,))
CUBE, IMAGES = (lambda n, d, k: (2, n, d)), (lambda n, d, k: (2, 8, n, d))
SEQUENCES = lambda n, d, k: (4, d, n)  # noqa: E731  (N, C, L)

CASES = {   # name -> (inputs (g, uneven) -> torch tensors, the call on torch tensors or DTensors alike)
    "broadcast_to": (_floats(ROW), lambda x: torch.broadcast_to(x, (3, x.shape[0]))),
    "x.broadcast_to": (_floats(MATRIX), lambda x: x[:1].broadcast_to(x.shape)),
    "tile": (_floats(MATRIX), lambda x: x.tile((2,))),
    "torch.tile": (_floats(MATRIX), lambda x: torch.tile(x, (2, 1, 1))),
    "ravel": (_floats(MATRIX), lambda x: x.ravel()),
    "torch.ravel": (_floats(CUBE), lambda x: torch.ravel(x)),
    "hstack": (_floats(MATRIX, MATRIX), lambda x, y: torch.hstack([x, y])),
    "hstack vectors": (_floats(ROW, COLUMN), lambda x, y: torch.hstack((x, y))),
    "vstack": (_floats(MATRIX, MATRIX), lambda x, y: torch.vstack([x, y])),
    "vstack vectors": (_floats(ROW, ROW), lambda x, y: torch.vstack([x, y])),
    "row_stack": (_floats(MATRIX, ROW), lambda x, y: torch.row_stack([x, y])),
    "dstack": (_floats(MATRIX, MATRIX), lambda x, y: torch.dstack([x, y])),
    "column_stack": (_floats(COLUMN, MATRIX), lambda x, y: torch.column_stack([x, y])),
    "atleast_3d": (_floats(MATRIX, ROW), lambda x, y: torch.atleast_3d(x, y)),
    "tensor_split sections": (_floats(MATRIX), lambda x: x.tensor_split(3)),
    "tensor_split indices": (_floats(MATRIX), lambda x: torch.tensor_split(x, [1, 3], dim=1)),
    "tensor_split past the end": (_floats(MATRIX), lambda x: torch.tensor_split(x, (2, 9, -1))),
    "hsplit": (_floats(MATRIX), lambda x: torch.hsplit(x, [1, 3])),
    "hsplit vector": (_floats(COLUMN), lambda x: x.hsplit([2])),
    "vsplit": (_floats(MATRIX), lambda x: torch.vsplit(x, [2])),
    "dsplit": (_floats(CUBE), lambda x: x.transpose(0, 2).dsplit([1])),
    "diff": (_floats(MATRIX), lambda x: x.diff()),
    "diff twice along 0": (_floats(MATRIX), lambda x: torch.diff(x, n=2, dim=0)),
    "diff prepend append": (_floats(MATRIX), lambda x: torch.diff(x, dim=1, prepend=x[:, :1] * 2, append=x[:, -2:])),
    "diff of bools": (_floats(MATRIX), lambda x: (x > 0).diff(dim=0)),
    "take_along_dim": (_with(_floats(MATRIX), lambda g, u: torch.randint(0, _sizes(u)[1], (_sizes(u)[0], 3),
                                                                           generator=g)),
                       lambda x, i: torch.take_along_dim(x, i, dim=1)),
    "take_along_dim broadcast": (_with(_floats(MATRIX), lambda g, u: torch.randint(0, _sizes(u)[0], (2, 1),
                                                                                     generator=g)),
                                 lambda x, i: x.take_along_dim(i, 0)),
    "take_along_dim flat": (_with(_floats(MATRIX), lambda g, u: torch.randint(0, 20, (6,), generator=g)),
                            lambda x, i: torch.take_along_dim(x, i)),
    "chain_matmul": (_floats(MATRIX, lambda n, d, k: (d, k), lambda n, d, k: (k, n)),
                     lambda a, b, c: torch.chain_matmul(a, b, c)),
    "linalg.multi_dot": (_floats(COLUMN, MATRIX, lambda n, d, k: (d, k), lambda n, d, k: (k,)),
                         lambda v, a, b, w: torch.linalg.multi_dot([v, a, b, w])),
    "kron": (_floats(MATRIX, lambda n, d, k: (2, 3)), lambda a, b: torch.kron(a, b)),
    "x.kron of ranks 1 and 2": (_floats(COLUMN, lambda n, d, k: (3, 2)), lambda a, b: a.kron(b)),
    "normalize": (_floats(MATRIX), lambda x: F.normalize(x)),
    "normalize p=1 dim 0": (_floats(MATRIX), lambda x: F.normalize(x, p=1.0, dim=0)),
    "cosine_similarity": (_floats(MATRIX, MATRIX), lambda x, y: F.cosine_similarity(x, y)),
    # float64: the gradient w.r.t. the broadcast row is zero up to rounding (cos is scale-invariant
    # in a constant column), and a row element near 0 scales that rounding by 1/|y_j|
    "cosine_similarity dim 0 broadcast": (lambda g, uneven: [v.double() for v in _floats(MATRIX, ROW)(g, uneven)],
                                          lambda x, y: torch.cosine_similarity(x, y, dim=0)),
    "pairwise_distance": (_floats(MATRIX, MATRIX), lambda x, y: F.pairwise_distance(x, y)),
    "pairwise_distance p=1 keepdim": (_floats(MATRIX, MATRIX), lambda x, y: F.pairwise_distance(x, y, 1.0,
                                                                                               keepdim=True)),
    "one_hot": (lambda g, u: [torch.randint(0, 5, _sizes(u)[:2], generator=g)], lambda t: F.one_hot(t, 5)),
    "conv1d": (_floats(SEQUENCES, lambda n, d, k: (6, d, 3), lambda n, d, k: (6,)),
               lambda x, w, b: F.conv1d(x, w, b, padding=1)),
    "conv1d strided same": (_floats(SEQUENCES, lambda n, d, k: (4, d, 3)),
                            lambda x, w: F.conv1d(x, w, stride=(1,), padding="same", dilation=2)),
    "conv1d batch of 3": (_floats(lambda n, d, k: (3, d, n), lambda n, d, k: (4, d, 3)),
                          lambda x, w: F.conv1d(x, w)),   # a rank's batch shard is empty (RunOp.regather)
    "prelu": (_floats(SEQUENCES, lambda n, d, k: (d,)), lambda x, w: F.prelu(x, w)),
    "prelu one weight": (_floats(MATRIX, lambda n, d, k: (1,)), lambda x, w: torch.prelu(x, w)),
    "pixel_shuffle": (_floats(IMAGES), lambda x: F.pixel_shuffle(x, 2)),
    "pixel_unshuffle": (_floats(lambda n, d, k: (2, 2, 2 * n, 2 * d)), lambda x: F.pixel_unshuffle(x, 2)),
    "margin_ranking_loss": (_with(_floats(COLUMN, COLUMN), _signs(lambda n, d, k: n)),
                            lambda x, y, t: F.margin_ranking_loss(x, y, t, margin=0.1)),
    "margin_ranking_loss none": (_with(_floats(COLUMN, COLUMN), _signs(lambda n, d, k: n)),
                                 lambda x, y, t: F.margin_ranking_loss(x, y, t, reduction="none")),
    "cosine_embedding_loss": (_with(_floats(MATRIX, MATRIX), _signs(lambda n, d, k: n)),
                              lambda x, y, t: F.cosine_embedding_loss(x, y, t, margin=0.2)),
    "cosine_embedding_loss sum": (_with(_floats(MATRIX, MATRIX), _signs(lambda n, d, k: n)),
                                  lambda x, y, t: F.cosine_embedding_loss(x, y, t, reduction="sum")),
    "triplet_margin_loss": (_floats(MATRIX, MATRIX, MATRIX), lambda a, p, n: F.triplet_margin_loss(a, p, n)),
    "triplet_margin_loss swap p=1": (_floats(MATRIX, MATRIX, MATRIX),
                                     lambda a, p, n: F.triplet_margin_loss(a, p, n, p=1, swap=True, reduction="none")),
    # order statistics (dtorch/torch_api/order.py)
    "argsort": (_floats(MATRIX), lambda x: torch.argsort(x)),
    "argsort dim 0 descending": (_floats(CUBE), lambda x: x.argsort(dim=1, descending=True)),
    "msort": (_floats(MATRIX), lambda x: torch.msort(x)),
    "quantile": (_floats(MATRIX), lambda x: torch.quantile(x, 0.3)),
    "quantile along dims": (_floats(CUBE), lambda x: (x.quantile(0.75, dim=1), torch.quantile(x, 0.5, dim=-1,
                                                                                              keepdim=True))),
    "quantile of many q": (_with(_floats(MATRIX), lambda g, u: torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])),
                           lambda x, q: torch.quantile(x, q, dim=0, keepdim=True)),
    "quantile interpolations": (_floats(MATRIX), lambda x: tuple(torch.quantile(x, 0.4, dim=1, interpolation=mode)
                                                                 for mode in ("lower", "higher", "midpoint",
                                                                              "nearest"))),
    "nanquantile": (lambda g, u: [torch.where(torch.rand(_sizes(u)[:2], generator=g) < 0.3, float("nan"),
                                              torch.randn(_sizes(u)[:2], generator=g))],
                    lambda x: tuple(torch.nan_to_num(q, nan=-9.0) for q in (   # (the comparison's NaN)
                        torch.nanquantile(x, 0.5, dim=1), x.nanquantile(0.2, dim=0, interpolation="higher"),
                        torch.quantile(x, 0.5, dim=1)))),   # quantile: NaN where a row holds one
    # torch's other spellings of dtorch's ops (dtorch/torch_api/methods.py, dtorch/torch_api/compositions.py)
    "greater and kin": (_floats(MATRIX, MATRIX), lambda x, y: (torch.greater(x, y), x.greater_equal(0.1), x.less(y),
                                                                torch.less_equal(x, y), x.not_equal(y))),
    "ger": (_floats(ROW, COLUMN), lambda x, y: torch.ger(y, x)),
    "split_with_sizes": (_floats(MATRIX), lambda x: x.split_with_sizes([1, x.shape[1] - 1], dim=1)),
    "unsafe_chunk and unsafe_split": (_floats(MATRIX), lambda x: torch.unsafe_chunk(x, 2) + x.unsafe_split(3)),
    "narrow_copy": (_floats(MATRIX), lambda x: x.narrow_copy(0, 1, 3)),
    # statistics and flat indices (dtorch/torch_api/stats.py)
    "cov": (_floats(MATRIX), lambda x: (torch.cov(x), x.T.cov(correction=0), torch.cov(x[0]))),
    "cov weighted": (_with(_floats(MATRIX), lambda g, u: torch.randint(1, 4, (_sizes(u)[1],), generator=g),
                           lambda g, u: torch.rand(_sizes(u)[1], generator=g)),
                     lambda x, f, a: torch.cov(x, fweights=f, aweights=a)),
    "corrcoef": (_floats(MATRIX), lambda x: torch.corrcoef(x.T)),
    "histc": (_floats(MATRIX), lambda x: (torch.histc(x, 7), x.histc(4, -1.0, 0.5), torch.histc(x * 0, 3))),
    "take": (_with(_floats(MATRIX), lambda g, u: torch.randint(-5, 12, (2, 3), generator=g)),
             lambda x, i: torch.take(x, i)),
    "diagflat": (_floats(ROW), lambda x: (torch.diagflat(x), x.diagflat(-1))),
}


def _outputs(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _reference(values, call, g):
    """torch's outputs and the gradients of sum_i <out_i, w_i> for fixed random weights."""
    leaves = [v.clone().requires_grad_() if v.is_floating_point() else v for v in values]
    outs = _outputs(call(*leaves))
    weights = [torch.randn(o.shape, generator=g) if o.is_floating_point() else None for o in outs]
    floats = [leaf for leaf in leaves if leaf.requires_grad]
    roots = [(o * w).sum() for o, w in zip(outs, weights) if w is not None and o.requires_grad]
    grads = torch.autograd.grad(sum(roots), floats, allow_unused=True) if roots and floats else []
    return [o.detach() for o in outs], weights, [torch.zeros_like(f) if d is None else d for f, d in zip(floats, grads)]


def _check(mesh, values, layout, call, g):
    want, weights, want_grads = _reference(values, call, g)
    inputs = [dtorch.tensor(v, device_mesh=mesh, placements=[_placement(d, v) for d in layout],
                            requires_grad=v.is_floating_point()) for v in values]
    outs = _outputs(call(*inputs))
    assert len(outs) == len(want)
    for got, expected in zip(outs, want):
        read = got.to_torch()
        assert read.dtype == expected.dtype and read.shape == expected.shape
        torch.testing.assert_close(read, expected, rtol=1e-4, atol=1e-5)
    roots = [(o * dtorch.tensor(w, device_mesh=mesh)).sum() for o, w in zip(outs, weights)
             if w is not None and o.requires_grad]
    if not roots:
        return
    dtorch.autograd.backward(roots)
    floats = [x for x in inputs if x.requires_grad]
    for x, expected in zip(floats, want_grads):   # no gradient (a target only compared): torch's zeros
        got = torch.zeros_like(expected) if x.grad is None else x.grad.to_torch()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mesh_name", list(LAYOUTS))
def test_a_composite_and_its_gradients_equal_torchs(name, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    make, call = CASES[name]
    for uneven in (False, True):
        g = torch.Generator().manual_seed(zlib.crc32(repr((name, uneven)).encode()))   # not hash(): salted per run
        values = make(g, uneven)
        for layout in LAYOUTS[mesh_name]:
            _check(mesh, values, layout, call, g)


def test_refusals_say_what_is_missing(mesh4):
    labels = dtorch.tensor(torch.tensor([0, 2, 1]), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError, match="num_classes"):
        F.one_hot(labels)
    x = dtorch.tensor(torch.randn(4, 5), device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(RuntimeError, match="not divisible by the split_size 2"):
        torch.hsplit(x, 2)
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        torch.take_along_dim(x, dtorch.tensor(torch.tensor([0]), device_mesh=mesh4), dim=0)


def test_reads_and_attributes_answer_as_torch(mesh4):
    """torch.equal / allclose read one bool back; is_cuda, nbytes and kin are the logical tensor's."""
    values = torch.randn(7, 3)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)])
    y = dtorch.tensor(values, device_mesh=mesh4, placements=[Replicate()])
    assert torch.equal(x, y) and x.equal(y) and not torch.equal(x, y + 1) and not torch.equal(x, y[:6])
    assert torch.allclose(x, y + 1e-7) and not x.allclose(y + 1e-3) and torch.allclose(x, y[0] * 0 + y)
    nan = dtorch.tensor(torch.tensor([1.0, float("nan")]), device_mesh=mesh4)
    assert not torch.allclose(nan, nan) and torch.allclose(nan, nan, equal_nan=True)
    assert (x.is_cuda, x.is_cpu, x.nbytes, x.itemsize, x.layout) == (False, True, values.nbytes, 4, torch.strided)
    assert not x.is_conj() and not x.is_neg() and x.resolve_conj() is x and torch.resolve_neg(x) is x
    for cast in ("byte", "char", "short"):
        assert torch.equal(getattr(x * 4, cast)().to_torch(), getattr(values * 4, cast)())


def test_quantile_refusals_are_torchs(mesh4):
    values = torch.randn(4, 5)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)])
    for call, message in [(lambda t: torch.quantile(t, 1.5), "q must be in the range .0, 1. but got 1.5"),
                          (lambda t: t.quantile(torch.tensor([0.5, -0.1])), "q values must be in the range"),
                          (lambda t: t.quantile(torch.tensor([[0.5]])), "q must be a scalar or 1D"),
                          (lambda t: t.nanquantile(0.5, interpolation="cubic"), "interpolation must be one of"),
                          (lambda t: t.long().quantile(0.5), "must be either float or double")]:
        for tensor in (values, x):
            with pytest.raises(RuntimeError, match=message):
                call(tensor)


def test_views_stay_views(mesh4):
    """broadcast_to, ravel and tensor_split's pieces are views in torch: a write through one reaches x."""
    values = torch.randn(8, 4)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(1)])
    first, _ = x.tensor_split(2)
    first.mul_(0)
    x.ravel()[-1:].fill_(7.0)
    values[:4] = 0
    values[-1, -1] = 7.0
    torch.testing.assert_close(x.to_torch(), values)
