"""Autograd's API against torch's (accumulation, grad mode, in-place rules, autograd.grad, errors),
each redistribute's dual, failures, and Llama's gradients against transformers on every layout.
(tests/test_grad_sweep.py sweeps every op's gradient over placements.)"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.spec.placements import init_device_mesh
from dtorch.errors import DTorchError

pytestmark = pytest.mark.timeout(300)


def _up(value, mesh, placements, **kwargs):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements, **kwargs)


def test_a_replicated_weight_with_a_batch_sharded_input_gets_the_global_batch_gradient(mesh4):
    x, w = torch.randn(10, 4), torch.randn(4, 3)
    dx, dw = _up(x, mesh4, [Shard(0)]), _up(w, mesh4, [Replicate()], requires_grad=True)
    loss = (dx @ dw).tanh().mean()
    loss.backward()
    reference = w.clone().requires_grad_()
    (x @ reference).tanh().mean().backward()
    assert dw.grad.placements == (Replicate(),)
    torch.testing.assert_close(dw.grad.to_torch(), reference.grad)


def test_gradients_accumulate_and_under_no_sync_are_reduced_once_per_read(mesh4):
    w = _up(torch.randn(4, 3), mesh4, [Replicate()], requires_grad=True)
    x = dtorch.randn(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    (x @ w).sum().backward()
    first = w.grad.to_torch()
    before = dtorch.stats()["commands_sent"]
    with dtorch.autograd.no_sync():
        (x @ w).sum().backward()
        (x @ w).sum().backward()
    assert w._node.grad.placements == (Partial(),)   # pending: the read reduces it, once
    assert dtorch.stats()["commands_sent"] - before < 20   # two forwards and backwards, no per-op reduction
    torch.testing.assert_close(w.grad.to_torch(), 3 * first)
    (x @ w).sum().backward()        # outside no_sync: reduced by this backward, the earlier sum included
    torch.testing.assert_close(w.grad.to_torch(), 4 * first)
    w.grad = None
    assert w.grad is None
    (x @ w).sum().backward()
    torch.testing.assert_close(w.grad.to_torch(), first)


def test_backward_with_a_gradient_and_partial_roots(mesh22):
    a = torch.randn(4, 6)
    x = _up(a, mesh22, [Shard(0), Shard(1)], requires_grad=True)
    y = x * 3
    g = torch.randn(4, 6)
    y.backward(_up(g, mesh22, [Replicate(), Replicate()]))
    torch.testing.assert_close(x.grad.to_torch(), 3 * g)
    assert x.grad.placements == (Shard(0), Shard(1))
    p = _up(a, mesh22, [Partial(), Replicate()], requires_grad=True)   # a Partial leaf: gradient R, shown as P
    (p.sum() * 2).backward()
    assert p.grad.placements == (Partial(), Replicate())
    torch.testing.assert_close(p.grad.to_torch(), torch.full_like(a, 2.0))


@pytest.mark.parametrize("pair", [("S0", "R"), ("S1", "S0"), ("P", "R"), ("P", "S0"), ("R", "S1"), ("R", "P")])
def test_each_redistribute_has_its_dual(pair, mesh4):
    names = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    a, weights = torch.randn(7, 5), torch.randn(7, 5)
    x = _up(a, mesh4, [names[pair[0]]], requires_grad=True)
    moved = x.redistribute(placements=[names[pair[1]]])
    (moved * _up(weights, mesh4, [Replicate()])).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), weights)


@pytest.mark.timeout(300)
def test_every_redistribute_between_2d_layouts_has_its_dual(mesh22):
    """A gathered leaf's buffer is gathered again in backward instead of kept (fsdp), but only
    where every rank of the gather's group saves it alike: [R, S(0)] -> [S(0), P(sum)] gathers,
    slices and partializes, which leaves a view of the buffer on some ranks and zeros on others,
    and their backwards waited for each other in different collectives (a hang)."""
    value, weights = torch.randn(5, 3), torch.randn(5, 3)
    w = _up(weights, mesh22, [Replicate(), Replicate()])
    layouts = list(itertools.product([Replicate(), Shard(0), Shard(1), Partial()], repeat=2))
    for src in layouts:
        x = _up(value, mesh22, list(src), requires_grad=True)
        loss = sum((x.redistribute(placements=list(dst)) * w).sum() for dst in layouts)
        loss.backward()
        torch.testing.assert_close(x.grad.to_torch(), len(layouts) * weights, msg=str(src))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_a_replicate_made_partial_by_max_min_or_avg_gets_its_gradient(mesh22, op):
    """R -> P(max|min|avg) gives every rank a copy; the reduction's own backward splits the
    gradient among the copies, so the partialize's dual passes each share on (it raised on the
    workers at backward time before)."""
    value, weights = torch.randn(5, 3), torch.randn(5, 3)
    w = _up(weights, mesh22, [Replicate(), Replicate()])
    for src, partial_dim in itertools.product([[Replicate(), Replicate()], [Shard(0), Replicate()],
                                               [Replicate(), Shard(1)]], [0, 1]):
        x = _up(value, mesh22, src, requires_grad=True)
        dst = [Replicate(), Replicate()]
        dst[partial_dim] = Partial(op)
        back = x.redistribute(placements=dst).redistribute(placements=src)
        torch.testing.assert_close(back.to_torch(), value)
        (back * w).sum().backward()
        torch.testing.assert_close(x.grad.to_torch(), weights, msg=f"{src} -> {dst}")


@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_a_loss_held_partial_by_max_min_or_avg_is_reduced_before_its_seed(mesh22, op):
    """backward() on a P(avg|max|min) root raised "only P(sum) partials have gradients": a seed
    cannot say how such parts split the gradient. The root is reduced inside the graph first."""
    value, weights = torch.randn(4, 3), torch.randn(4, 3)
    x = _up(value, mesh22, [Shard(0), Replicate()], requires_grad=True)
    loss = (x * _up(weights, mesh22, [Replicate(), Replicate()])).sum().redistribute(
        placements=[Partial(op), Partial("sum")] if op == "avg" else [Replicate(), Partial(op)])
    (grad,) = dtorch.autograd.grad(loss, [x], retain_graph=True)
    torch.testing.assert_close(grad.to_torch(), weights)
    loss.backward()
    torch.testing.assert_close(x.grad.to_torch(), weights)


def test_a_weight_without_grad_sliced_for_its_op_stays_without_grad(mesh4):
    """A Replicate weight that an op slices to its input's Shard went through a recorded slice
    and reached torch's kernel requiring grad; torch then refused where it has no derivative
    ("not differentiable with respect to argument 'weight'")."""
    logits, labels, weight = torch.randn(8, 6), (torch.rand(8, 6) > 0.5).float(), torch.rand(8, 6)
    pos_weight = torch.rand(6) * 3
    for placements, kwargs in (([Shard(0)], {"weight": _up(weight, mesh4, [Replicate()])}),
                               ([Shard(1)], {"pos_weight": pos_weight})):
        x = _up(logits, mesh4, placements, requires_grad=True)
        F.binary_cross_entropy_with_logits(x, _up(labels, mesh4, placements), **kwargs).backward()
        plain = {k: (v.to_torch() if isinstance(v, dtorch.DTensor) else v) for k, v in kwargs.items()}
        t = logits.clone().requires_grad_()
        F.binary_cross_entropy_with_logits(t, labels, **plain).backward()
        torch.testing.assert_close(x.grad.to_torch(), t.grad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch", [5, 3, 8])
def test_a_gathered_weight_beside_an_empty_batch_shard_is_not_gathered_again(mesh4, batch):
    """conv2d takes torch's empty-input shortcut on a rank whose batch shard is empty and saves
    nothing, while the other ranks saved the gathered weight as the way to gather it again: their
    backward waited in that gather for the empty rank (a hang). Where some rank holds an empty
    piece, the controller tells the workers to save gathered parameters whole (RunOp.regather)."""
    x, w = torch.randn(batch, 3, 4, 6), torch.randn(4, 3, 2, 3)
    dx = _up(x, mesh4, [Shard(0)], requires_grad=True)
    dw = _up(w, mesh4, [Shard(0)], requires_grad=True)
    F.conv2d(dx, dw).square().sum().backward()
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.conv2d(tx, tw).square().sum().backward()
    torch.testing.assert_close(dx.grad.to_torch(), tx.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.grad.to_torch(), tw.grad, rtol=1e-5, atol=1e-4)


def test_dtorch_grad_contexts_inside_torch_no_grad_leave_recording_on(mesh4):
    """dtorch.no_grad() (which dtorch itself enters: batch norm's running statistics, optimizer
    steps) saved the combined mode, False under torch.no_grad(), and restored it as dtorch's own:
    after an evaluation under torch.no_grad(), autograd recorded nothing for good."""
    x = _up(torch.randn(4, 4), mesh4, [Shard(0)], requires_grad=True)
    with torch.no_grad():
        with dtorch.no_grad():
            pass
        with dtorch.enable_grad():
            pass
        with dtorch.set_grad_enabled(False):
            pass
        assert not (x * 2).requires_grad
    assert dtorch.is_grad_enabled() and (x * 2).requires_grad


def test_grad_mode_and_leaves(mesh4):
    x = _up(torch.randn(4, 4), mesh4, [Shard(0)], requires_grad=True)
    with dtorch.no_grad():
        y = x * 2
    assert not y.requires_grad and x.requires_grad and x.is_leaf
    z = x * 2
    assert z.requires_grad and not z.is_leaf and z.grad_fn is not None
    assert not x.detach().requires_grad
    assert not (x > 0).requires_grad        # integer and bool outputs carry no gradient
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        z.requires_grad_(False)
    with pytest.raises(RuntimeError, match="floating point"):
        dtorch.zeros(3, dtype=torch.int64, device_mesh=mesh4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        z.backward()
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    with dtorch.set_grad_enabled(False):
        assert not dtorch.is_grad_enabled()
    assert dtorch.is_grad_enabled()


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_a_refused_write_through_a_view_of_a_leaf_changes_nothing(mesh4, placements):
    """torch refuses an in-place op on a view of a leaf that requires grad; dtorch refused it
    only at the leaf, after the view had taken the new value (the base kept the old one)."""
    value = torch.randn(4, 6)
    x = _up(value, mesh4, placements, requires_grad=True)
    views = {"t()": (x.t(), value.t()), "[1:]": (x[1:], value[1:]), "view(-1)": (x.view(-1), value.view(-1))}
    for name, (view, expected) in views.items():
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            view.add_(1)
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            view[0] = 5.0
        assert torch.equal(view.to_torch(), expected), name
    assert torch.equal(x.to_torch(), value)
    with dtorch.no_grad():      # allowed there, as in torch: the base follows
        x[1:].mul_(2)
    value[1:] *= 2
    assert torch.equal(x.to_torch(), value) and x.is_leaf and x.requires_grad


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(0)]], ids=str)
def test_a_write_through_a_diagonal_has_torchs_gradients(mesh4, placements):
    a, d = torch.randn(6, 6), torch.randn(6)
    ta, td = a.clone().requires_grad_(True), d.clone().requires_grad_(True)
    y = ta * 2
    y.diagonal().mul_(td)
    (y.tanh() * torch.arange(36.0).view(6, 6)).sum().backward()
    x, w = _up(a, mesh4, placements, requires_grad=True), _up(d, mesh4, [Replicate()], requires_grad=True)
    z = x * 2
    z.diagonal().mul_(w)
    (z.tanh() * _up(torch.arange(36.0).view(6, 6), mesh4, [Replicate()])).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), ta.grad)
    torch.testing.assert_close(w.grad.to_torch(), td.grad)


def test_torchs_own_no_grad_stops_recording_too(mesh4):
    """Evaluation loops, torch.nn.init and hand-written optimizers use torch.no_grad(): under it,
    dtorch records nothing and a leaf may change in place, as in torch."""
    x = _up(torch.ones(4, 4), mesh4, [Shard(0)], requires_grad=True)
    with torch.no_grad():
        y = x * 3
        x.mul_(2)
        assert not dtorch.is_grad_enabled()
    assert not y.requires_grad and x.is_leaf and x.requires_grad and dtorch.is_grad_enabled()

    @torch.no_grad()
    def evaluate(t):
        return (t * t).sum()
    assert not evaluate(x).requires_grad
    with torch.inference_mode():
        assert not (x + 1).requires_grad
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), torch.full((4, 4), 4.0))


def test_in_place_updates_under_no_grad_keep_the_leaf(mesh4):
    a = torch.randn(4, 3)
    w = _up(a, mesh4, [Replicate()], requires_grad=True)
    x = dtorch.randn(6, 4, device_mesh=mesh4, placements=[Shard(0)])
    (x @ w).sum().backward()
    g = w.grad.to_torch()
    with dtorch.no_grad():
        w -= 0.5 * w.grad
    assert w.is_leaf and w.requires_grad
    torch.testing.assert_close(w.to_torch(), a - 0.5 * g)
    (x @ w).sum().backward()        # the gradient stayed bound to the leaf: it accumulates
    torch.testing.assert_close(w.grad.to_torch(), 2 * g)
    h = w * 2
    h.mul_(3)                       # in place on a non-leaf: recorded like any op
    h.sum().backward()
    torch.testing.assert_close(w.grad.to_torch(), 2 * g + 6)


def test_autograd_grad_returns_without_accumulating(mesh22):
    a = torch.randn(6, 4)
    x = _up(a, mesh22, [Shard(0), Replicate()], requires_grad=True)
    mid = x.sin()
    out = (mid * mid).sum()
    gx, gmid = dtorch.autograd.grad(out, [x, mid], retain_graph=True)
    torch.testing.assert_close(gx.to_torch(), 2 * a.sin() * a.cos())
    torch.testing.assert_close(gmid.to_torch(), 2 * a.sin())
    assert x.grad is None
    unused = _up(a, mesh22, [Replicate(), Replicate()], requires_grad=True)
    with pytest.raises(RuntimeError, match="not used in the graph"):
        dtorch.autograd.grad(out, [unused], retain_graph=True)
    assert dtorch.autograd.grad(out, [unused], allow_unused=True)[0] is None


def test_torchs_autograd_grad_and_backward_take_dtensors(mesh4):
    """torch.autograd.grad / backward reach dtorch through __torch_function__, with torch's own
    keywords (only_inputs, is_grads_batched) and a dict of inputs."""
    w, x = torch.randn(6, 3, requires_grad=True), torch.randn(8, 6)
    dw = _up(w.detach(), mesh4, [Replicate()], requires_grad=True)
    dx = _up(x, mesh4, [Shard(0)])
    loss, dloss = (x @ w).square().mean(), (dx @ dw).square().mean()
    (want,) = torch.autograd.grad(loss, w, retain_graph=True)
    (got,) = torch.autograd.grad(dloss, dw, retain_graph=True, only_inputs=True)
    torch.testing.assert_close(got.to_torch(), want)
    assert torch.autograd.grad(dloss, {"w": dw}, retain_graph=True)["w"].placements == (Replicate(),)
    with pytest.raises(NotImplementedError, match="is_grads_batched"):
        torch.autograd.grad(dloss, [dw], retain_graph=True, is_grads_batched=True)
    torch.autograd.backward(loss)
    torch.autograd.backward(dloss)
    torch.testing.assert_close(dw.grad.to_torch(), w.grad)
    seed = torch.randn(8)
    torch.autograd.backward([(x @ w).sum(1)], [seed])
    torch.autograd.backward([(dx @ dw).sum(1)], [_up(seed, mesh4, [Shard(0)])])
    torch.testing.assert_close(dw.grad.to_torch(), w.grad)


_RETAINED = {"mesh4": [([Shard(0)], [Replicate()]), ([Replicate()], [Shard(1)]), ([Shard(1)], [Shard(0)]),
                       ([Replicate()], [Replicate()])],
             "mesh22": [([Shard(0), Replicate()], [Replicate(), Shard(1)]),
                        ([Shard(0), Shard(1)], [Replicate(), Shard(0)])]}


@pytest.mark.parametrize("mesh_name, number", [(m, i) for m, cases in _RETAINED.items() for i in range(len(cases))])
def test_retain_grad_keeps_an_intermediates_gradient_as_torch_does(mesh_name, number, request):
    """x @ w is S, R or P(sum) by the inputs' placements; its .grad (and tanh's, and the loss's)
    equal torch's, accumulate over two backwards, and start again from zero after `.grad = None`."""
    mesh = request.getfixturevalue(mesh_name)
    x_placements, w_placements = _RETAINED[mesh_name][number]
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    x, w = _up(a, mesh, x_placements, requires_grad=True), _up(b, mesh, w_placements, requires_grad=True)
    h = x @ w
    act = h.tanh()
    loss = (act * act).sum()
    for kept in (h, act, loss, x):
        kept.retain_grad()
    assert h.retains_grad and act.retains_grad and not x.retains_grad and h.grad is None
    loss.backward(retain_graph=True)
    (act.sum() * 3).backward(retain_graph=True)
    rx, rw = a.clone().requires_grad_(), b.clone().requires_grad_()
    rh = rx @ rw
    ract = rh.tanh()
    rloss = (ract * ract).sum()
    for kept in (rh, ract, rloss):
        kept.retain_grad()
    rloss.backward(retain_graph=True)
    (ract.sum() * 3).backward(retain_graph=True)
    for mine, theirs in ((h, rh), (act, ract), (loss, rloss), (x, rx), (w, rw)):
        assert mine.grad.placements == mine.placements
        torch.testing.assert_close(mine.grad.to_torch(), theirs.grad, rtol=1e-4, atol=1e-5)
    h.grad = None
    assert h.grad is None
    act.sum().backward()
    torch.testing.assert_close(h.grad.to_torch(), 1 - ract.detach() ** 2, rtol=1e-4, atol=1e-5)


def test_retain_grad_is_refused_where_torch_refuses_and_inside_compile(mesh4):
    plain = _up(torch.randn(4), mesh4, [Shard(0)])
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        plain.retain_grad()
    leaf = _up(torch.randn(4), mesh4, [Shard(0)], requires_grad=True)
    leaf.retain_grad()   # a leaf keeps its gradient anyway
    middle = leaf * 2
    with pytest.raises(NotImplementedError, match=r"P\(max\)"):
        middle.redistribute(placements=[Partial("max")]).retain_grad()
    with pytest.raises(RuntimeError, match="can only be cleared"):
        middle.grad = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])

    @dtorch.compile
    def step(x):
        y = x.exp()
        y.retain_grad()
        y.sum().backward()
        return y
    with pytest.raises(NotImplementedError, match="retain_grad"):
        step(leaf)


def _change_grads_in_place(p, x, torch_module):
    """Ways programs change a gradient in place between backward calls (gradient scaling, manual
    clipping, masking), each followed by another backward that must accumulate onto the change."""
    (p * x).sum().backward()
    p.grad.mul_(0.5)
    (p * x).sum().backward()
    p.grad.detach().clamp_(-0.3, 0.3)
    (p * x).sum().backward()
    with torch_module.no_grad():
        p.grad[0] = 7.0
    (p * x * x).sum().backward()
    return p.grad


@pytest.mark.parametrize("mesh_name, placements", [("mesh4", [Shard(0)]), ("mesh4", [Replicate()]),
                                                   ("mesh4", [Shard(1)]), ("mesh22", [Shard(0), Replicate()])])
def test_a_gradient_changed_in_place_is_what_the_next_backward_adds_to(mesh_name, placements, request):
    mesh = request.getfixturevalue(mesh_name)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    expected = _change_grads_in_place(a.clone().requires_grad_(), b, torch)
    p = _up(a, mesh, placements, requires_grad=True)
    got = _change_grads_in_place(p, _up(b, mesh, placements), dtorch)
    torch.testing.assert_close(got.to_torch(), expected)
    dtorch.optim.SGD([p], lr=0.1).step()
    torch.testing.assert_close(p.to_torch(), a - 0.1 * expected)


def test_data_is_detached_and_shares_memory(mesh4):
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    p, x = _up(a, mesh4, [Shard(0)], requires_grad=True), _up(b, mesh4, [Shard(0)])
    assert not (p.data * x).requires_grad and not p.data.requires_grad
    (p * x).sum().backward()
    p.data.mul_(0.5)                                # grad mode on: allowed through .data, as in torch
    ema = dtorch.zeros(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    ema.data.mul_(0.9).add_(p.data, alpha=0.1)
    assert p.is_leaf and p.requires_grad
    torch.testing.assert_close(p.to_torch(), a * 0.5)
    torch.testing.assert_close(ema.to_torch(), 0.05 * a)
    torch.testing.assert_close(p.grad.to_torch(), b)


def test_a_second_backward_without_retain_graph_is_refused(mesh4):
    x = _up(torch.randn(4), mesh4, [Shard(0)], requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(x.grad.to_torch(), 4 * x.to_torch())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_a_failed_forward_op_comes_back_at_the_gradient_read(mesh4):
    x = _up(torch.randn(4, 4), mesh4, [Shard(0)], requires_grad=True)
    table = _up(torch.randn(4, 2), mesh4, [Replicate()], requires_grad=True)
    looked_up = dtorch.nn.functional.embedding(_up(torch.tensor([0, 7]), mesh4, [Replicate()]), table)  # row 7 of 4
    (looked_up.sum() + (x * 2).sum()).backward()
    with pytest.raises(DTorchError, match="embedding"):
        x.grad.to_torch()
    x.grad = None
    (x * 3).sum().backward()        # the session goes on
    torch.testing.assert_close(x.grad.to_torch(), torch.full((4, 4), 3.0))


# --- Llama's gradients against transformers ----------------------------------------------------------
transformers = pytest.importorskip("transformers")

LAYOUTS = {   # name -> (mesh shape, mesh dim names)
    "dp2": ((2,), ["dp"]), "fsdp2": ((2,), ["fsdp"]), "tp2": ((2,), ["tp"]), "cp2": ((2,), ["cp"]),
    "pp2": ((2,), ["pp"]), "fsdp2xtp2": ((2, 2), ["fsdp", "tp"]), "dp2xpp2": ((2, 2), ["dp", "pp"]),
}


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(1))
    out = reference(ids, labels=ids)
    out.loss.backward()
    return reference, ids, out.loss.item(), {k: p.grad for k, p in reference.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_gradients_equal_transformers(layout, llama, session):
    from dtorch.models import LlamaForCausalLM
    reference, ids, loss, grads = llama
    shape, names = LAYOUTS[layout]
    model = LlamaForCausalLM(reference.config, device_mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    model.load_state_dict(reference.state_dict())
    out = model(ids, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - loss) < 1e-5
    for name, param in model.named_parameters():
        assert param.grad.placements == param.placements, name
        torch.testing.assert_close(param.grad.to_torch(), grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_ring_attention_gradients_equal_torch(causal, gqa, mesh4):
    """q, k, v sharded on the sequence (uneven: 10 over 4 ranks): the ring runs again in backward."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 10, 8, generator=g)
    k, v = (torch.randn(2, 2 if gqa else 4, 10, 8, generator=g) for _ in range(2))
    weights = torch.randn(2, 4, 10, 8, generator=g)
    leaves = [_up(t, mesh4, [Shard(2)], requires_grad=True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    (out * _up(weights, mesh4, [Replicate()])).sum().backward()
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*reference, is_causal=causal, enable_gqa=gqa)
    (expected * weights).sum().backward()
    for got, want in zip(leaves, reference):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5)


def test_data_parallel_gradients_are_reduced_inside_the_backward(mesh4):
    """A Replicate weight's gradient comes out of the Backward already reduced (the workers
    all-reduce it in buckets while the backward runs, as DDP does): reading it costs no command."""
    w, b, x = torch.randn(6, 5), torch.randn(5), torch.randn(10, 6)   # 10 rows: uneven over 4 ranks
    dw, db = _up(w, mesh4, [Replicate()], requires_grad=True), _up(b, mesh4, [Replicate()], requires_grad=True)
    (_up(x, mesh4, [Shard(0)]) @ dw + db).tanh().mean().backward()
    tw, tb = w.clone().requires_grad_(), b.clone().requires_grad_()
    (x @ tw + tb).tanh().mean().backward()
    before = dtorch.stats()["commands_sent"]
    grads = dw.grad, db.grad
    assert dtorch.stats()["commands_sent"] == before
    assert [g.placements for g in grads] == [(Replicate(),)] * 2
    torch.testing.assert_close(grads[0].to_torch(), tw.grad)
    torch.testing.assert_close(grads[1].to_torch(), tb.grad)


def test_module_no_sync_is_ddps_spelling(mesh4):
    layer = dtorch.nn.Linear(4, 3, device_mesh=mesh4)
    x = dtorch.randn(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    with layer.no_sync():
        layer(x).sum().backward()
    assert layer.weight._node.grad.placements == (Partial(),)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad.to_torch(), 2 * x.to_torch().sum(0).expand(3, 4))


@pytest.mark.parametrize("one_leaf_per_bucket", [False, True])
def test_gradient_buckets_meet_the_backwards_own_collectives_on_a_2d_mesh(mesh22, one_leaf_per_bucket, monkeypatch):
    """Buckets go out while the backward still runs collectives of the same ranks (the dual of a
    P(sum) -> R all-reduce between the layers, a tp weight's reduction over "tp"): a group of
    their own keeps every rank's order the same. One leaf per bucket makes every leaf a launch."""
    if one_leaf_per_bucket:
        monkeypatch.setattr(dtorch.autograd.placement_rules, "FIRST_BUCKET_BYTES", 1)
        monkeypatch.setattr(dtorch.autograd.placement_rules, "BUCKET_BYTES", 1)
    torch.manual_seed(3)
    x, w1, w2, w3, s = torch.randn(6, 4), torch.randn(4, 8), torch.randn(8, 5), torch.randn(5, 5), torch.randn(5)
    dx = _up(x, mesh22, [Shard(0), Replicate()])
    d1 = _up(w1, mesh22, [Replicate(), Shard(1)], requires_grad=True)     # column parallel over "tp"
    d2 = _up(w2, mesh22, [Replicate(), Shard(0)], requires_grad=True)     # row parallel: P(sum) out
    d3 = _up(w3, mesh22, [Replicate(), Replicate()], requires_grad=True)
    ds = _up(s, mesh22, [Replicate(), Replicate()], requires_grad=True)
    h = (dx @ d1).relu() @ d2                                            # [S(0), P(sum)]
    h = h.redistribute(placements=[Shard(0), Replicate()])                # all-reduce; backward: its dual
    ((h * ds).tanh() @ d3).pow(2).mean().backward()
    leaves = [t.clone().requires_grad_() for t in (w1, w2, w3, s)]
    t1, t2, t3, ts = leaves
    (((x @ t1).relu() @ t2 * ts).tanh() @ t3).pow(2).mean().backward()
    for ours, theirs in zip((d1, d2, d3, ds), leaves):
        assert ours.grad.placements == ours.placements
        torch.testing.assert_close(ours.grad.to_torch(), theirs.grad)


def test_a_gradient_held_across_the_next_backward_keeps_its_value(mesh4):
    """Workers keep their gradient bucket buffers from one backward to the next, but reuse one
    only when no gradient view of it is alive: a gradient the user holds is never overwritten."""
    w = _up(torch.randn(4, 3), mesh4, [Replicate()], requires_grad=True)
    x = dtorch.randn(8, 4, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(2):   # the second round reuses the first round's buffer (nothing holds it by then)
        w.grad = None
        (x @ w).sum().backward()
    kept = w.grad
    value = kept.to_torch()
    w.grad = None
    ((x @ w) * 3).sum().backward()
    torch.testing.assert_close(w.grad.to_torch(), 3 * value)
    assert torch.equal(kept.to_torch(), value)
