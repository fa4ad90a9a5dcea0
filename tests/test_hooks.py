"""Tensor hooks on leaves (dtorch/autograd/hooks.py) against torch's on the same values:
p.register_hook(fn) changes the gradient each backward brings (accumulated onto the old one),
autograd.grad applies it too, handles remove it, and p.register_post_accumulate_grad_hook(fn)
sees the complete .grad after each backward (an optimizer step inside backward). On one and two
mesh dims, sharded and replicated parameters, with the data-parallel buckets and dtorch.compile."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.errors import UnsupportedOpError

R = Replicate()


def _pair(values: torch.Tensor, mesh, placements):
    return (dtorch.tensor(values, device_mesh=mesh, placements=placements).requires_grad_(),
            values.clone().requires_grad_())


def _loss(x, w):
    return ((x @ w).tanh() ** 2).sum()


LAYOUTS = [("mesh4", [Shard(0)]), ("mesh4", [R]), ("mesh4", [Shard(1)]), ("mesh22", [Shard(0), R]),
           ("mesh22", [R, Shard(1)])]


@pytest.mark.parametrize("mesh_name,placements", LAYOUTS, ids=str)
def test_leaf_hooks_change_each_backwards_gradient_as_torchs(mesh_name, placements, request):
    mesh = request.getfixturevalue(mesh_name)
    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(6, 5, generator=g), torch.randn(5, 3, generator=g)
    x, tx = _pair(a, mesh, placements)
    dw, tw = dtorch.tensor(w, device_mesh=mesh, placements=[R] * mesh.ndim), w
    seen = []
    clip = x.register_hook(lambda grad: grad.clamp(-0.1, 0.1))
    tx.register_hook(lambda grad: grad.clamp(-0.1, 0.1))
    x.register_hook(lambda grad: seen.append(grad.shape))          # None: the gradient as it is
    scale = x.register_hook(lambda grad: grad * 3)
    tscale = tx.register_hook(lambda grad: grad * 3)
    for _ in range(2):   # the second backward adds its hooked gradient to the first
        _loss(x, dw).backward()
        _loss(tx, tw).backward()
        torch.testing.assert_close(x.grad.to_torch(), tx.grad)
    (got,), (want,) = dtorch.autograd.grad(_loss(x, dw), x), torch.autograd.grad(_loss(tx, tw), tx)
    torch.testing.assert_close(got.to_torch(), want)
    scale.remove(), tscale.remove()
    _loss(x, dw).backward()
    _loss(tx, tw).backward()
    torch.testing.assert_close(x.grad.to_torch(), tx.grad)
    assert seen == [(6, 5)] * 4 and clip.id in x._node.hooks


def test_post_accumulate_hooks_step_inside_backward(mesh4):
    """Optimizer in backward: each parameter's hook steps it and drops its .grad, as torch's."""
    g = torch.Generator().manual_seed(2)
    w1, w2, data = torch.randn(5, 4, generator=g), torch.randn(4, 2, generator=g), torch.randn(8, 5, generator=g)
    params = [dtorch.tensor(w1, device_mesh=mesh4, placements=[R]).requires_grad_(),
              dtorch.tensor(w2, device_mesh=mesh4, placements=[Shard(0)]).requires_grad_()]
    reference = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    steps = []

    def sgd(p):
        steps.append(p.shape)
        with torch.no_grad():
            p.sub_(p.grad * 0.1)
        p.grad = None
    for p in params + reference:
        p.register_post_accumulate_grad_hook(sgd)
    x = dtorch.tensor(data, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(3):
        ((x @ params[0]).relu() @ params[1]).square().mean().backward()
        ((data @ reference[0]).relu() @ reference[1]).square().mean().backward()
    for p, t in zip(params, reference):
        torch.testing.assert_close(p.to_torch(), t.detach())
        assert p.grad is None
    assert len(steps) == 12


def test_hooked_leaves_leave_the_buckets_and_the_rest_still_reduce(mesh4):
    """Replicate parameters' gradients are all-reduced in buckets inside the backward; a hooked
    one takes its gradient apart, and both come out equal to torch's."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(6, 6, generator=g) for _ in range(4)]
    data = torch.randn(8, 6, generator=g)
    params = [dtorch.tensor(w, device_mesh=mesh4, placements=[R]).requires_grad_() for w in weights]
    reference = [w.clone().requires_grad_() for w in weights]
    params[1].register_hook(lambda grad: grad * 0.5)
    reference[1].register_hook(lambda grad: grad * 0.5)
    x = dtorch.tensor(data, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(2):
        h, th = x, data
        for p, t in zip(params, reference):
            h, th = (h @ p).tanh(), (th @ t).tanh()
        h.sum().backward()
        th.sum().backward()
    for p, t in zip(params, reference):
        torch.testing.assert_close(p.grad.to_torch(), t.grad, rtol=1e-5, atol=1e-6)


def test_compiled_steps_replay_the_hooks(mesh4):
    g = torch.Generator().manual_seed(4)
    w, data = torch.randn(5, 3, generator=g), torch.randn(8, 5, generator=g)
    p, t = _pair(w, mesh4, [R])
    p.register_hook(lambda grad: grad.clamp(-0.2, 0.2))
    t.register_hook(lambda grad: grad.clamp(-0.2, 0.2))

    @dtorch.compile
    def step(x):
        ((x @ p).sin()).sum().backward()

    x = dtorch.tensor(data, device_mesh=mesh4, placements=[Shard(0)])
    for i in range(4):
        step(x * (i + 1))
        (((data * (i + 1)) @ t).sin()).sum().backward()
        torch.testing.assert_close(p.grad.to_torch(), t.grad)
    assert step.captures == 2   # the first call starts from no .grad, the others add to one


def test_hook_refusals(mesh4):
    x = dtorch.randn(4, 3, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
        x.register_hook(lambda grad: grad)
    x.requires_grad_()
    with pytest.raises(UnsupportedOpError, match="test_hooks.py.*register it on a leaf"):
        (x * 2).register_hook(lambda grad: grad)
    with pytest.raises(RuntimeError, match="post accumulate grad hooks cannot be registered on non-leaf tensors"):
        (x * 2).register_post_accumulate_grad_hook(lambda p: None)
    x.register_hook(lambda grad: grad.sum(0))
    with pytest.raises(RuntimeError, match="has changed the size of value"):
        (x * 2).sum().backward()


def test_hooks_in_strict_mode(mesh4):
    """The engine's own moves are explicit: a hook that keeps the gradient's placements works
    in strict mode, where nothing is inserted."""
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    p, t = _pair(w, mesh4, [R])
    p.register_hook(lambda grad: grad * 0.5)
    t.register_hook(lambda grad: grad * 0.5)
    x = dtorch.ones(8, 5, device_mesh=mesh4, placements=[Shard(0)])
    before = dtorch.is_strict()
    dtorch.set_strict(True)
    try:
        for _ in range(2):
            (x @ p).sum().backward()
            _ = p.grad   # read: reduced to Replicate, so the next backward's sum needs a move back
    finally:
        dtorch.set_strict(before)
    for _ in range(2):
        (torch.ones(8, 5) @ t).sum().backward()
    torch.testing.assert_close(p.grad.to_torch(), t.grad)
