"""The workers' saved-tensor hooks (runtime/kernels.pack_saved / unpack_saved), which a recorded
op runs under when an input is an fsdp-gathered parameter (kernels.saves_gathered): plain tensors come
back with torch's gradients and leave no reference cycle behind (a retained graph, as pipeline
stages keep, must go with its tensors), and the gathered parameter is saved as the way to gather
it again, not as the gathered tensor."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.runtime.worker.kernels import (DifferentiableStep, _all_gather, _Regather, pack_saved,
                                           saves_gathered, unpack_saved)

pytestmark = pytest.mark.timeout(60)


def _recorded(fn, *inputs):
    with torch.enable_grad(), saved_tensors_hooks(pack_saved, unpack_saved):
        return fn(*inputs)


@pytest.mark.parametrize("op", [torch.exp, torch.tanh, torch.sigmoid], ids=lambda f: f.__name__)
def test_an_op_that_saves_its_output_frees_its_graph_after_a_retained_backward(op):
    """exp, tanh, sigmoid save their own output: held as is by the hook, it held its grad_fn,
    which held it, and a backward with retain_graph=True (each pipeline stage's) never broke
    the cycle. Every training step's graph stayed on the workers (20 MiB a step on pp2)."""
    x = torch.randn(64, requires_grad=True)
    y = _recorded(op, x)
    y.sum().backward(retain_graph=True)
    freed = weakref.ref(y)
    del y
    gc.collect()
    assert freed() is None, "the op's output is still held: its graph would never be freed"


@pytest.mark.parametrize("op", [
    lambda a, b: (a.exp() * b.sigmoid()).tanh(),
    lambda a, b: F.silu(a @ b.t()).sum(-1),
    lambda a, b: F.scaled_dot_product_attention(a.view(1, 2, 4, 4), b.view(1, 2, 4, 4), b.view(1, 2, 4, 4),
                                                is_causal=True),
    lambda a, b: F.rms_norm(a, (4,), b[0]) * b,
], ids=["pointwise", "matmul-silu", "sdpa", "rms_norm"])
def test_gradients_through_the_hooks_equal_torch(op):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    ours = [t.clone().requires_grad_() for t in (a, b)]
    theirs = [t.clone().requires_grad_() for t in (a, b)]
    _recorded(op, *ours).sum().backward()
    op(*theirs).sum().backward()
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine.grad, torchs.grad)


class _OneRankComm:
    """The communicator of a group of one: a collective over one piece is that piece; counts
    the all-gathers."""

    def __init__(self):
        self.gathers = 0

    def all_gather(self, ranks, tensor):
        self.gathers += 1
        return tensor.unsqueeze(0).clone()

    def reduce_scatter(self, ranks, stacked, reduce_op):
        return stacked[0].clone()


def test_only_a_redistribute_of_gathers_alone_is_gathered_again_in_backward():
    """apply_steps lets backward gather a leaf's buffer again only when every step is a gather:
    a slice or a partialize after it leaves the buffer's views on some ranks only (a hang)."""
    from dtorch.runtime.worker.kernels import _only_gathers
    mesh = SimpleNamespace(shape=(2, 2))
    assert _only_gathers([(0, Shard(0), Replicate())], mesh)
    assert _only_gathers([(0, Shard(0), Replicate()), (1, Shard(1), Replicate())], mesh)
    assert not _only_gathers([(1, Shard(0), Replicate()), (0, Replicate(), Shard(0))], mesh)
    assert not _only_gathers([(0, Shard(0), Replicate()), (1, Replicate(), Partial())], mesh)
    # a no-op step:
    assert _only_gathers([(0, Shard(0), Replicate()), (1, Replicate(), Partial())], SimpleNamespace(shape=(2, 1)))


def test_a_gathered_parameter_is_saved_as_its_recipe_and_gathered_again_in_backward():
    comm = _OneRankComm()
    shard = torch.randn(6, 4, requires_grad=True)   # a parameter's shard: a leaf
    anchor = torch.zeros((), requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    packed = []

    def pack(tensor):
        packed.append(pack_saved(tensor))
        return packed[-1]

    with torch.enable_grad():
        whole = DifferentiableStep.apply(shard, anchor, _all_gather, Shard(0), Replicate(), (6, 4), (0,), 0, comm,
                                         True)   # (apply_steps: True when every step is a gather)
        assert saves_gathered([x, whole.t()])   # a view of it counts too
        assert not saves_gathered([x, shard])   # torch's own saving
        with saved_tensors_hooks(pack, unpack_saved):
            out = F.linear(x, whole)   # saves the gathered weight (a view of it, weight.t())
    assert comm.gathers == 1
    assert any(type(p) is _Regather for p in packed), "the gathered weight was saved as a tensor"
    assert not any(isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                   for p in packed), "the gathered storage is held until backward"
    out.sum().backward()
    assert comm.gathers == 2, "backward did not gather the parameter again"
    reference_shard, reference_x = shard.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    F.linear(reference_x, reference_shard).sum().backward()
    assert torch.equal(x.grad, reference_x.grad)
    assert torch.equal(shard.grad, reference_shard.grad)


class _OnePeer:
    """fsdp_gather's peers object for a group of one, counting the all-gathers."""
    size, index = 1, 0

    def __init__(self):
        self.gathers = 0

    def all_gather(self, tensor):
        self.gathers += 1
        return tensor.unsqueeze(0).clone()

    def reduce_scatter(self, stacked):
        return stacked[0].clone()


def test_a_gathered_group_is_gathered_again_once_in_backward_and_dropped_after_it():
    """fully_shard's grouped gather: the ops that save its members (two linears, one of them
    twice) make backward gather the whole group again ONCE, at the first unpack; the group's
    own backward (the reduce-scatter) drops what it gathered. Gradients equal torch's."""
    from dtorch.runtime.worker.fsdp_gather import _GatheredGroup, _Layout
    peers = _OnePeer()
    shards = [torch.randn(6, 4, requires_grad=True), torch.randn(3, 6, requires_grad=True)]
    layout = _Layout([((0, 0), [6, 4]), ((0, 0), [3, 6])], [0, 0], peers, torch.float32, "cpu")
    x = torch.randn(5, 4, requires_grad=True)
    with torch.enable_grad(), saved_tensors_hooks(pack_saved, unpack_saved):
        first, second = _GatheredGroup.apply(layout, peers, (True, True), torch.float32, None,
                                             torch.zeros((), requires_grad=True), *shards)
        out = F.linear(F.linear(x, first).tanh(), second) + F.linear(x, first).sum()
    assert peers.gathers == 1
    group = first._dtorch_regather.group
    out.sum().backward()
    assert peers.gathers == 2, "backward gathered the group once per saved member, or never"
    assert group.gathered is None, "the group gathered in backward is still held"
    reference = [t.detach().clone().requires_grad_() for t in (*shards, x)]
    (F.linear(F.linear(reference[2], reference[0]).tanh(), reference[1]) + F.linear(reference[2], reference[0]).sum()
     ).sum().backward()
    for mine, theirs in zip((*shards, x), reference):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_group_gathered_again_is_dropped_when_backward_never_reaches_its_node():
    """autograd.grad with respect to an input only, the graph retained: the group's own node
    never runs, so the end of the backward pass drops what it gathered (it stayed while the graph
    lived: 64 MiB more per worker for four 2048 x 2048 layers in a probe)."""
    from dtorch.runtime.worker.fsdp_gather import _GatheredGroup, _Layout
    peers = _OnePeer()
    shard = torch.randn(6, 4, requires_grad=True)
    layout = _Layout([((0, 0), [6, 4])], [0], peers, torch.float32, "cpu")
    x = torch.randn(5, 4, requires_grad=True)
    with torch.enable_grad(), saved_tensors_hooks(pack_saved, unpack_saved):
        (weight,) = _GatheredGroup.apply(layout, peers, (True, True), torch.float32, None,
                                         torch.zeros((), requires_grad=True), shard)
        out = F.linear(x, weight).tanh().sum()
    group = weight._dtorch_regather.group
    (grad,) = torch.autograd.grad(out, [x], retain_graph=True)
    assert peers.gathers == 2 and group.gathered is None
    reference = x.detach().clone().requires_grad_()
    F.linear(reference, shard.detach()).tanh().sum().backward()
    torch.testing.assert_close(grad, reference.grad)
