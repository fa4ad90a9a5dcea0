"""Plain torch tensors beside DTensors (issue 42, "Mixed operands"): a loss's target, class weights,
a mask, an index, a KV cache's empty seed. Each is uploaded with the placements the rule needs,
so every call equals torch's on the same values, loss and gradient of the logits, on meshes (1,),
(2,) and (2, 2), with the logits sharded on the batch, replicated, or sharded on the class dim,
even and uneven. Then empty tensors in cat and stack, on every sharded dim."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from dtorch.spec.placements import init_device_mesh

pytestmark = pytest.mark.timeout(600)

BATCH, CLASSES, WHOLE = 0, 1, None
LAYOUTS = {"mesh1": [[BATCH], [WHOLE], [CLASSES]], "mesh2": [[BATCH], [WHOLE], [CLASSES]],
           "mesh22": [[BATCH, CLASSES], [WHOLE, BATCH], [CLASSES, WHOLE]]}


@pytest.fixture(scope="module")
def mesh2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


def _placements(layout):
    return [Replicate() if dim is None else Shard(dim) for dim in layout]


# --- the operands, given (g, n, c): n rows of c classes -----------------------------------------------
def _classes(ignored: bool = False):
    def make(g, n, c):
        target = torch.randint(0, c, (n,), generator=g)
        if ignored:
            target[::3] = -100
        return target
    return make


def _floats(shape_of, positive: bool = False):
    def make(g, n, c):
        value = torch.randn(shape_of(n, c), generator=g)
        return value.abs() + 0.1 if positive else value
    return make


def _probabilities(g, n, c):
    return torch.rand(n, c, generator=g).softmax(1)


def _signs(shape_of):
    return lambda g, n, c: torch.randint(0, 2, shape_of(n, c), generator=g).float() * 2 - 1


def _bits(g, n, c):
    return torch.randint(0, 2, (n, c), generator=g).float()


def _index(shape_of, high_of):
    return lambda g, n, c: torch.randint(0, high_of(n, c), shape_of(n, c), generator=g)


MATRIX, ROWS, CLASS_ROW = (lambda n, c: (n, c)), (lambda n, c: (n,)), (lambda n, c: (c,))
RANK = lambda n, c: (3, 2)  # noqa: E731

# name -> (operands beside the logits, the call on (logits, *operands), torch or dtorch alike)
CASES = {
    **{f"cross_entropy {reduction}": ([_classes()], lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r))
       for reduction in ("mean", "sum", "none")},
    **{f"nll_loss {reduction}": ([_classes()], lambda x, t, r=reduction: F.nll_loss(x.log_softmax(1), t, reduction=r))
       for reduction in ("mean", "sum", "none")},
    **{f"cross_entropy ignore_index {reduction}": ([_classes(ignored=True)],
                                                   lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r))
       for reduction in ("mean", "sum", "none")},
    "cross_entropy weight": ([_classes(), _floats(CLASS_ROW, positive=True)],
                             lambda x, t, w: F.cross_entropy(x, t, weight=w)),
    "cross_entropy weight ignore_index sum": ([_classes(ignored=True), _floats(CLASS_ROW, positive=True)],
                                              lambda x, t, w: F.cross_entropy(x, t, w, reduction="sum")),
    "cross_entropy label_smoothing": ([_classes()], lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
    "cross_entropy label_smoothing ignore_index none": (
        [_classes(ignored=True)], lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction="none")),
    "cross_entropy everything": ([_classes(ignored=True), _floats(CLASS_ROW, positive=True)],
                                 lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=-100, label_smoothing=0.1)),
    "cross_entropy probabilities": ([_probabilities], lambda x, t: F.cross_entropy(x, t)),
    "cross_entropy spatial": ([_index(lambda n, c: (n, 2), lambda n, c: c)],   # (N, C, L) logits, (N, L) targets
                              lambda x, t: F.cross_entropy(torch.stack([x, x * 2], -1), t, reduction="none")),
    "nll_loss weight ignore_index": ([_classes(ignored=True), _floats(CLASS_ROW, positive=True)],
                                     lambda x, t, w: F.nll_loss(x.log_softmax(1), t, weight=w)),
    "torch.nn.CrossEntropyLoss": ([_classes(ignored=True)], lambda x, t: torch.nn.CrossEntropyLoss()(x, t)),
    **{f"{name} {reduction}": ([_floats(MATRIX)], lambda x, y, f=getattr(F, name), r=reduction: f(x, y, reduction=r))
       for name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss") for reduction in ("mean", "sum", "none")},
    "binary_cross_entropy": ([_bits, _floats(MATRIX, positive=True)],
                             lambda x, t, w: F.binary_cross_entropy(x.sigmoid(), t, weight=w)),
    "binary_cross_entropy_with_logits": (
        [_bits, _floats(CLASS_ROW, positive=True)],
        lambda x, t, p: F.binary_cross_entropy_with_logits(x, t, pos_weight=p, reduction="sum")),
    "kl_div batchmean": ([_probabilities], lambda x, t: F.kl_div(x.log_softmax(1), t, reduction="batchmean")),
    "poisson_nll_loss full": ([_floats(MATRIX, positive=True)], lambda x, t: F.poisson_nll_loss(x, t * 3, full=True)),
    "gaussian_nll_loss": ([_floats(MATRIX), _floats(MATRIX, positive=True)],
                          lambda x, t, v: F.gaussian_nll_loss(x, t, v, reduction="sum")),
    "hinge_embedding_loss": ([_signs(MATRIX)], lambda x, t: F.hinge_embedding_loss(x, t)),
    "multi_margin_loss": ([_classes(), _floats(CLASS_ROW, positive=True)],
                          lambda x, t, w: F.multi_margin_loss(x, t, weight=w)),
    "multilabel_soft_margin_loss": ([_bits], lambda x, t: F.multilabel_soft_margin_loss(x, t, reduction="none")),
    "soft_margin_loss": ([_signs(MATRIX)], lambda x, t: F.soft_margin_loss(x, t)),
    "margin_ranking_loss": ([_floats(MATRIX), _signs(MATRIX)], lambda x, y, t: F.margin_ranking_loss(x, y, t)),
    "cosine_embedding_loss": ([_floats(MATRIX), _signs(ROWS)], lambda x, y, t: F.cosine_embedding_loss(x, y, t)),
    # masks and indices
    "torch.where": ([_bits, _floats(MATRIX)], lambda x, m, y: torch.where(m > 0, x, y)),
    "masked_fill": ([_bits], lambda x, m: x.masked_fill(m > 0, 0.5)),
    "index_select classes": ([_index(lambda n, c: (4,), lambda n, c: c)], lambda x, i: torch.index_select(x, 1, i)),
    "index_select rows": ([_index(lambda n, c: (5,), lambda n, c: n)], lambda x, i: x.index_select(0, i)),
    "gather": ([_index(lambda n, c: (n, 2), lambda n, c: c)], lambda x, i: x.gather(1, i)),
    "embedding": ([_index(RANK, lambda n, c: n)], lambda x, i: F.embedding(i, x)),
    "take_along_dim": ([_index(lambda n, c: (n, 3), lambda n, c: c)], lambda x, i: torch.take_along_dim(x, i, 1)),
}


def _sizes(uneven: bool):
    return (7, 5) if uneven else (8, 6)


def _reference(logits, operands, call, g):
    """torch's result, the weights of the gradient's root, and the gradient of the logits."""
    leaf = logits.clone().requires_grad_()
    out = call(leaf, *operands)
    weights = torch.randn(out.shape, generator=g)
    (grad,) = torch.autograd.grad((out * weights).sum(), leaf)
    return out.detach(), weights, grad


def _check(mesh, layout, logits, operands, call, g):
    want, weights, want_grad = _reference(logits, operands, call, g)
    x = dtorch.tensor(logits, device_mesh=mesh, placements=_placements(layout), requires_grad=True)
    out = call(x, *operands)
    read = out.to_torch()
    assert read.dtype == want.dtype and read.shape == want.shape, (read.shape, want.shape)
    torch.testing.assert_close(read, want, rtol=1e-4, atol=1e-5)
    (out * weights).sum().backward()   # the root's weights: one more plain operand
    torch.testing.assert_close(x.grad.to_torch(), want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mesh_name", list(LAYOUTS))
def test_a_plain_operand_equals_torch(name, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    makes, call = CASES[name]
    for uneven in (False, True):
        g = torch.Generator().manual_seed(zlib.crc32(repr((name, uneven)).encode()))
        n, c = _sizes(uneven)
        logits, operands = torch.randn(n, c, generator=g), [make(g, n, c) for make in makes]
        for layout in LAYOUTS[mesh_name]:
            _check(mesh, layout, logits, operands, call, g)


def test_a_plain_target_is_uploaded_once(mesh22):
    """transformers' loss: labels.to(logits.device) keeps a plain tensor; cross_entropy takes it
    (and a plain weight) beside logits sharded on the batch, and uploads each once."""
    logits = torch.randn(8, 6)
    labels, weight = torch.tensor([0, 5, -100, 2, 3, 1, -100, 4]), torch.rand(6) + 0.5
    x = dtorch.tensor(logits, device_mesh=mesh22, placements=[Shard(0), Replicate()])
    before = dtorch.stats()["local_tensors_uploaded"]
    loss = F.cross_entropy(x, labels, weight)
    assert dtorch.stats()["local_tensors_uploaded"] - before == 2
    torch.testing.assert_close(loss.to_torch(), F.cross_entropy(logits, labels, weight))
    direct = dtorch.nn.functional.nll_loss(x.log_softmax(1), labels, reduction="sum")   # dtorch's own spelling
    torch.testing.assert_close(direct.to_torch(), F.nll_loss(logits.log_softmax(1), labels, reduction="sum"))


def test_strict_mode_refuses_a_plain_target_with_what_to_write(mesh22, strict):
    x = dtorch.tensor(torch.randn(8, 6), device_mesh=mesh22, placements=[Shard(0), Replicate()])
    with pytest.raises(dtorch.LocalTensorError, match=r"cross_entropy: a local torch.Tensor of shape \(8,\) beside "
                                                      r"DTensors \[S\(0\), R\] on DeviceMesh.*as \[R, R\]: "
                                                      r"dtorch.distribute_tensor\(t, mesh, \[Replicate\(\), "):
        F.cross_entropy(x, torch.zeros(8, dtype=torch.long))


# --- empty tensors in cat and stack (transformers' DynamicCache starts with torch.tensor([])) ---------
CACHE_LAYOUTS = {"mesh1": [[0], [3]], "mesh2": [[0], [1], [2], [3], [None]],
                 "mesh22": [[1, 3], [0, 2], [2, None], [None, 1]]}


def _empties(mesh, key: torch.Tensor, dim: int, layout):
    """The empty operands torch's cat accepts beside `key`: the (0,) legacy empty, plain or a
    DTensor (replicated or sharded), and key's own shape with 0 along `dim` (replicated or laid
    like key)."""
    legacy, matching = torch.tensor([]), key.narrow(dim, 0, 0).clone()
    yield legacy
    yield dtorch.tensor(legacy, device_mesh=mesh)
    yield dtorch.tensor(legacy, device_mesh=mesh, placements=[Shard(0)] * mesh.ndim)
    yield matching
    yield dtorch.tensor(matching, device_mesh=mesh)
    yield dtorch.tensor(matching, device_mesh=mesh, placements=_placements(layout))


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("mesh_name", list(CACHE_LAYOUTS))
def test_cat_joins_empty_tensors_on_every_sharded_dim(mesh_name, uneven, request):
    mesh = request.getfixturevalue(mesh_name)
    g = torch.Generator().manual_seed(7 + uneven)
    values = torch.randn((3, 5, 3, 7) if uneven else (2, 4, 3, 8), generator=g)
    weights = torch.randn(values.shape, generator=g)
    for layout in CACHE_LAYOUTS[mesh_name]:
        for dim in (-2, 1):
            for empty in _empties(mesh, values, dim, layout):
                for first in (True, False):
                    k = dtorch.tensor(values, device_mesh=mesh, placements=_placements(layout), requires_grad=True)
                    joined = torch.cat([empty, k] if first else [k, empty], dim=dim)
                    assert joined.placements == k.placements   # no gather, wherever k is sharded
                    torch.testing.assert_close(joined.to_torch(), values)
                    (joined * weights).sum().backward()
                    torch.testing.assert_close(k.grad.to_torch(), weights)


def test_the_kv_cache_pattern_moves_nothing(mesh22):
    """cat([torch.tensor([]), k], -2), then the next step's key appended: no inserted redistribute,
    and dtorch.cat spells it too."""
    values, more = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8)
    k = dtorch.tensor(values, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    step = dtorch.tensor(more, device_mesh=mesh22, placements=[Shard(0), Shard(1)])
    before = dtorch.stats()["redistributes_inserted"]
    cache = dtorch.cat([torch.tensor([]), k], dim=-2)
    cache = torch.cat([cache, step], dim=-2)
    assert dtorch.stats()["redistributes_inserted"] == before
    torch.testing.assert_close(cache.to_torch(), torch.cat([values, more], -2))


def test_cat_of_empties_only_is_torchs(mesh2):
    empty = dtorch.tensor(torch.tensor([]), device_mesh=mesh2, placements=[Shard(0)])
    assert tuple(torch.cat([empty, torch.tensor([])]).to_torch().shape) == (0,)
    rows = dtorch.tensor(torch.zeros(0, 4), device_mesh=mesh2, placements=[Shard(1)])
    torch.testing.assert_close(torch.cat([rows, torch.tensor([]), rows]).to_torch(), torch.zeros(0, 4))


def test_cat_along_a_sharded_dim_of_two_nonempty_inputs_still_gathers(mesh2):
    """Only where one input alone has elements along the cat dim may it stay sharded there."""
    values = torch.randn(4, 6)
    x = dtorch.tensor(values, device_mesh=mesh2, placements=[Shard(0)])
    torch.testing.assert_close(torch.cat([x, x[:1]]).to_torch(), torch.cat([values, values[:1]]))


@pytest.mark.parametrize("mesh_name", ["mesh2", "mesh22"])
def test_stack_of_empty_tensors_is_torchs(mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    for shape in ((0,), (3, 0, 4), (0, 5)):
        for dim in range(len(shape)):
            placements = [Shard(dim)] + [Replicate()] * (mesh.ndim - 1)
            a = dtorch.tensor(torch.zeros(shape), device_mesh=mesh, placements=placements)
            for new_dim in range(len(shape) + 1):
                expected = torch.stack([torch.zeros(shape), torch.zeros(shape)], new_dim)
                got = torch.stack([a, torch.zeros(shape)], new_dim).to_torch()
                assert got.shape == expected.shape
    with pytest.raises(Exception, match="stack expects each tensor to be equal size"):
        torch.stack([dtorch.tensor(torch.randn(2, 3), device_mesh=mesh), torch.tensor([])])


def test_stack_with_a_plain_operand_has_gradients(mesh22):
    values, other, weights = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 2, 3)
    x = dtorch.tensor(values, device_mesh=mesh22, placements=[Shard(0), Shard(1)], requires_grad=True)
    joined = torch.stack([x, other], 1)
    torch.testing.assert_close(joined.to_torch(), torch.stack([values, other], 1))
    (joined * weights).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), weights[:, 0])


def test_transformers_default_cache_on_tp2(session):
    """transformers' DynamicCache seeds each layer with torch.tensor([]) and cats the keys on -2:
    a tiny Qwen2 split by a tensor-parallel plan runs with its default cache (the heads, dim 1,
    sharded), a cached next step and labels= training, equal to torch."""
    transformers = pytest.importorskip("transformers")
    from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    reference = transformers.Qwen2ForCausalLM(config).eval()
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    dtorch.distribute_module(model, mesh)
    layers = "model.layers.*."
    parallelize_module(model, mesh, {
        **{layers + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        layers + "self_attn.o_proj": RowwiseParallel(),
        **{layers + f"mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")},
        layers + "mlp.down_proj": RowwiseParallel(),
    }, tp_dim="tp")
    ids, following = torch.randint(0, 64, (2, 5)), torch.randint(0, 64, (2, 1))
    want, got = reference(ids), model(dtorch.tensor(ids, device_mesh=mesh))
    torch.testing.assert_close(got.logits.to_torch(), want.logits)
    want = reference(following, cache=want.past_key_values)
    got = model(dtorch.tensor(following, device_mesh=mesh), cache=got.past_key_values)
    torch.testing.assert_close(got.logits.to_torch(), want.logits)
    reference(ids, labels=ids).loss.backward()
    loss = model(dtorch.tensor(ids, device_mesh=mesh), labels=ids).loss   # plain labels beside DTensor logits
    loss.backward()
    torch.testing.assert_close(loss.to_torch(), reference(ids, labels=ids).loss.detach())
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad.to_torch(), expected.grad, msg=name)
