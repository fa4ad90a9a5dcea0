"""Activation checkpointing (dtorch.utils.checkpoint, and torch.utils.checkpoint.checkpoint on
DTensors): the same losses, gradients and parameters as torch without checkpointing, on dp, fsdp
and dp x tp (whose regions hold collectives that backward runs again); dropout draws the same
mask when recomputed; dtorch.autograd.grad goes through a region; nested regions, a region inside
dtorch.compile, and what a region refuses; and the memory it saves on the workers."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as tnn
import torch.utils.checkpoint as torch_checkpoint

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from dtorch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.timeout(300)


class Block(tnn.Module):
    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.mlp = tnn.Sequential(tnn.Linear(width, 2 * width), tnn.GELU(), tnn.Linear(2 * width, width))
        self.norm = tnn.LayerNorm(width)
        self.dropout = tnn.Dropout(dropout)

    def forward(self, h):
        return h + self.dropout(self.mlp(self.norm(h)))


class Net(tnn.Module):
    def __init__(self, width: int = 8, blocks: int = 3, dropout: float = 0.0, checkpointed: bool = False):
        super().__init__()
        self.blocks = tnn.ModuleList(Block(width, dropout) for _ in range(blocks))
        self.checkpointed = checkpointed

    def forward(self, h):
        for block in self.blocks:
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return h


def _batch(step: int, rows: int = 6, width: int = 8) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(100 + step))


def _layout(model, layout, mesh4, mesh22):
    if layout == "dp2xtp2":
        plan = {f"blocks.{i}.mlp.0": ColwiseParallel() for i in range(len(model.blocks))}
        plan |= {f"blocks.{i}.mlp.2": RowwiseParallel() for i in range(len(model.blocks))}
        parallelize_module(model, mesh22, plan, tp_dim="tp")
        dtorch.distribute_module(model, mesh22)
        return mesh22, [Shard(0), Replicate()]
    dtorch.distribute_module(model, mesh4)
    if layout == "fsdp4":
        fully_shard(model, "dp")
    return mesh4, [Shard(0)]


def _train(model, steps: int, optimizer_class, place=lambda t: t):
    optimizer = optimizer_class(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        out = model(place(_batch(step)))
        loss = (out * out).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.item()))
    return losses


@pytest.mark.parametrize("layout", ["dp4", "fsdp4", "dp2xtp2"])
def test_checkpointed_blocks_train_as_torch_does(layout, mesh4, mesh22):
    """3 AdamW steps with every block checkpointed: each loss and the final parameters equal
    single-process torch's without checkpointing (an uneven batch of 6 over 4 ranks)."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    model.checkpointed = True
    mesh, batch = _layout(model, layout, mesh4, mesh22)
    expected = _train(reference, 3, torch.optim.AdamW)
    got = _train(model, 3, dtorch.optim.AdamW, lambda t: dtorch.distribute_tensor(t, mesh, batch))
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=0)
    for (name, param), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.to_torch(), theirs.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_recomputed_dropout_draws_the_forwards_mask(mesh4):
    """Dropout inside a region: the gradients equal those of the same dtorch model without
    checkpointing (the same seed, so the same masks), and the loss too."""
    results = []
    for checkpointed in (False, True):
        dtorch.manual_seed(7)
        torch.manual_seed(0)
        model = dtorch.distribute_module(Net(dropout=0.5, checkpointed=checkpointed), mesh4)
        x = dtorch.distribute_tensor(_batch(0), mesh4, [Shard(0)]).requires_grad_()
        loss = model(x).square().mean()
        loss.backward()
        results.append([loss.to_torch(), x.grad.to_torch()] + [p.grad.to_torch() for p in model.parameters()])
    for without, with_ in zip(*results):
        torch.testing.assert_close(with_, without, rtol=1e-6, atol=1e-7)


def test_autograd_grad_through_a_region_leaves_parameters_alone(mesh22):
    """dtorch.autograd.grad w.r.t. the input and one weight through a checkpointed tp block:
    torch's values, and no .grad accumulated anywhere (a nested backward would have)."""
    torch.manual_seed(1)
    reference = Block(8)
    block = copy.deepcopy(reference)
    parallelize_module(block, mesh22, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}, tp_dim="tp")
    dtorch.distribute_module(block, mesh22)
    x_local = _batch(1).requires_grad_()
    expected = torch.autograd.grad(reference(x_local).pow(3).sum(), [x_local, reference.mlp[0].weight])
    x = dtorch.distribute_tensor(_batch(1), mesh22, [Shard(0), Replicate()]).requires_grad_()
    got = dtorch.autograd.grad(checkpoint(block, x).pow(3).sum(), [x, block.mlp[0].weight])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.to_torch(), e, rtol=1e-4, atol=1e-5)
    assert all(p.grad is None for p in block.parameters())


def test_nested_regions_and_a_region_that_returns_several_tensors(mesh4):
    torch.manual_seed(2)
    w_local = torch.randn(8, 8, requires_grad=True)
    x_local = _batch(2).requires_grad_()

    def inner(h, w):
        return (h @ w).tanh()

    def outer(h, w):
        a = checkpoint(inner, h, w)
        return a, checkpoint(inner, a, w) * 2

    a, b = outer(x_local, w_local)
    (a.sum() + b.square().sum()).backward()
    w = dtorch.distribute_tensor(w_local.detach(), mesh4, [Replicate()]).requires_grad_()
    x = dtorch.distribute_tensor(x_local.detach(), mesh4, [Shard(0)]).requires_grad_()
    a, b = checkpoint(outer, x, w)
    (a.sum() + b.square().sum()).backward()
    torch.testing.assert_close(x.grad.to_torch(), x_local.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.to_torch(), w_local.grad, rtol=1e-5, atol=1e-6)


def test_a_compiled_training_step_with_checkpointed_blocks_equals_eager(mesh4):
    torch.manual_seed(3)
    reference = Net()
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    model.checkpointed = True
    optimizer = dtorch.optim.SGD(model.parameters(), lr=0.1)

    @dtorch.compile
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    expected = _train(reference, 4, lambda params, lr: torch.optim.SGD(params, lr=0.1))
    got = [float(step(dtorch.distribute_tensor(_batch(i), mesh4, [Shard(0)])).item()) for i in range(4)]
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=0)
    assert step.captures <= 2   # then replays


def test_what_a_region_cannot_hold_is_refused_at_its_line_and_nothing_is_lost(mesh4):
    """A backward or an optimizer step inside the checkpointed function raises at its own line,
    before any command goes out: the parameters stay usable (a step refused on the workers
    poisoned them)."""
    w = dtorch.ones(4, 4, device_mesh=mesh4, placements=[Replicate()], requires_grad=True)
    optimizer = dtorch.optim.SGD([w], lr=0.1)
    x = dtorch.ones(4, 4, device_mesh=mesh4, placements=[Shard(0)])
    (x @ w).sum().backward()

    def backward_inside(h):
        (h @ w).sum().backward()
        return h * 2

    def step_inside(h):
        optimizer.step()
        return h @ w

    for fn, command in ((backward_inside, "backward"), (step_inside, "SGD.step")):
        with pytest.raises(RuntimeError, match=f"({command}) at .*test_activation_checkpoint.py:.* cannot run inside "
                                               "dtorch.utils.checkpoint"):
            checkpoint(fn, x)
    dtorch.synchronize()
    optimizer.step()
    assert torch.equal(w.to_torch(), torch.full((4, 4), 1 - 0.1 * 4))
    with pytest.raises(NotImplementedError, match="selective activation checkpointing"):
        checkpoint(lambda h: h, w, context_fn=lambda: None)


def test_an_op_under_no_grad_inside_a_region_stays_out_of_the_gradient(mesh4):
    """Recomputed, each command records as its own grad flag says: `c` made under no_grad
    passed gradient to h when the recompute ran everything with grad (a wrong x.grad)."""
    def fn(h, center):
        with dtorch.no_grad():
            c = center * 0.5 + h.mean(0)
        return (h - c).tanh()
    local = torch.linspace(-1, 1, 32).reshape(8, 4).requires_grad_()
    with torch.no_grad():
        c = torch.zeros(4) * 0.5 + local.mean(0)
    (local - c).tanh().sum().backward()
    for placements in ([Replicate()], [Shard(0)]):
        x = dtorch.distribute_tensor(local.detach(), mesh4, placements).requires_grad_()
        checkpoint(fn, x, dtorch.zeros(4, device_mesh=mesh4, placements=[Replicate()])).sum().backward()
        torch.testing.assert_close(x.grad.to_torch(), local.grad)


def test_a_buffer_updated_under_no_grad_in_a_region_stays_a_buffer(mesh4):
    """A weight constrained in place and a running statistic with a collective, under no_grad
    inside the region: both stay plain tensors (they became outputs of the region's node: the
    weight's next backward failed, and the statistic's hung the next step's backward)."""
    class Centered(tnn.Module):
        def __init__(self):
            super().__init__()
            self.lin = tnn.Linear(4, 4)
            self.register_buffer("center", torch.zeros(4))

        def forward(self, h):
            with torch.no_grad():
                self.lin.weight.clamp_(-1, 1)
                self.center.mul_(0.9).add_(0.1 * h.mean(0))
            return (self.lin(h) - self.center).tanh()
    torch.manual_seed(0)
    reference = Centered()
    block = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    for step in range(3):
        x = _batch(step, rows=8, width=4)
        reference(x).sum().backward()
        checkpoint(block, dtorch.distribute_tensor(x, mesh4, [Shard(0)])).sum().backward()
        torch.testing.assert_close(block.center.to_torch(), reference.center)
        torch.testing.assert_close(block.lin.weight.grad.to_torch(), reference.lin.weight.grad, rtol=1e-5, atol=1e-6)
    (block.lin.weight * 2).sum().backward()   # outside any region
    assert block.lin.weight.is_leaf and block.lin.weight.grad is not None


def test_the_gradient_of_a_tensor_used_again_inside_a_region_is_refused_not_zero(mesh4):
    """`a` escapes the function and the function uses it: its uses are inside the region's one
    node, so its own gradient cannot be reached (it came back as zeros). The gradient of what
    flows through it, and of a region output nothing inside uses, are right."""
    x = dtorch.distribute_tensor(torch.linspace(-1, 1, 8).reshape(4, 2), mesh4, [Shard(0)]).requires_grad_()
    store = []

    def fn(t):
        a = t * 2
        store.append(a)
        return a.tanh()
    y = checkpoint(fn, x)
    with pytest.raises(dtorch.RemoteError, match="gradient of a tensor made inside dtorch.utils.checkpoint"):
        dtorch.autograd.grad(y.sum(), [store[0]], retain_graph=True)[0].to_torch()
    (y.sum() + 0.5 * store[0].sum()).backward()
    local = torch.linspace(-1, 1, 8).reshape(4, 2).requires_grad_()
    a = local * 2
    (a.tanh().sum() + 0.5 * a.sum()).backward()
    torch.testing.assert_close(x.grad.to_torch(), local.grad)
    p, q = checkpoint(lambda t: (t * 3, (t * 2).sin()), x)   # p: an output nothing inside uses
    (gp,) = dtorch.autograd.grad((p * q).sum(), [p])
    torch.testing.assert_close(gp.to_torch(), (local.detach() * 2).sin())


def test_torch_tensors_still_take_torchs_own_checkpoint():
    x = torch.ones(3, requires_grad=True)
    torch_checkpoint.checkpoint(lambda t: (t * 3).sin(), x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 3 * torch.cos(torch.full((3,), 3.0)))


_PEAK_SCRIPT = """
import json, sys, time, torch, dtorch
sys.path.insert(0, {root!r})
from benchmarks.process_memory import peak_mib, reset_peak
from tests.test_activation_checkpoint import Net
dtorch.init(num_workers=2)
try:
    mesh = dtorch.init_device_mesh("cpu", (2,))
    torch.manual_seed(4)
    wide = dtorch.distribute_module(Net(width=512, blocks=12), mesh)
    x = dtorch.distribute_tensor(torch.randn(1024, 512), mesh, [dtorch.Shard(0)]).requires_grad_()
    pids = [w["pid"] for w in dtorch.workers()]
    growth = {{}}
    for checkpointed in (False, True, False, True):
        wide.checkpointed = checkpointed
        dtorch.synchronize()
        for pid in pids:
            reset_peak(pid)
        base = [peak_mib(pid) for pid in pids]
        loss = wide(x).sum()
        dtorch.synchronize()
        growth[str(checkpointed)] = max(peak_mib(pid) - b for pid, b in zip(pids, base))
        loss.backward()
        del loss
    print(json.dumps(growth))
finally:
    dtorch.shutdown()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/<pid>/clear_refs")
def test_checkpointing_lowers_the_workers_peak_memory():
    """12 blocks of width 512 on 512 rows a rank: without checkpointing each block keeps ~7 MiB
    of activations a rank from its forward to backward; with it, the blocks keep their 1 MiB
    inputs only. Measured in a pool of its own whose workers return every block of 128 KiB or
    more to the system when freed (MALLOC_MMAP_THRESHOLD_, as benchmark 10 reads peak memory), so
    the peak is what the forward holds, not what earlier tests left in the heap."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT.format(root=root)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    assert growth["False"] > 40 and growth["True"] < 0.4 * growth["False"], growth
