"""torch.autocast on DTensors (dtorch/dtensor/autocast.py), against torch's own CPU autocast on the same
inputs: the ops on torch's lower-precision list compute in the autocast dtype, those on its
float32 list in float32, the rest in their inputs' dtypes, and backward casts the gradients back."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard

pytestmark = pytest.mark.timeout(300)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_training_step_under_autocast_equals_torchs(mesh4, dtype):
    model = _model()
    ours = dtorch.distribute_module(copy.deepcopy(model), mesh4)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    dx, dy = dtorch.distribute_tensor(x, mesh4, [Shard(0)]), dtorch.distribute_tensor(y, mesh4, [Shard(0)])
    with torch.autocast("cpu", dtype=dtype):
        logits, loss = model(x), None
        ours_logits = ours(dx)
        loss, ours_loss = F.cross_entropy(logits, y), F.cross_entropy(ours_logits, dy)
        scaled = torch.softmax(logits, -1).sum()   # softmax is on neither CPU list: its input's dtype
        ours_scaled = torch.softmax(ours_logits, -1).sum()
    assert ours_logits.dtype == logits.dtype == dtype and ours_loss.dtype == loss.dtype == torch.float32
    assert ours_scaled.dtype == scaled.dtype
    assert torch.equal(ours_logits.to_torch(), logits)   # the batch's rows: the same casts, the same kernels
    torch.testing.assert_close(ours_loss.to_torch(), loss, rtol=1e-6, atol=1e-6)
    loss.backward()
    ours_loss.backward()
    for p, q in zip(model.parameters(), ours.parameters()):
        assert q.grad.dtype == p.grad.dtype == torch.float32
        # bf16 / fp16 products, summed per rank then across ranks: torch's sum in another order
        torch.testing.assert_close(q.grad.to_torch(), p.grad, rtol=2e-2, atol=2e-3)


def test_autocast_off_float64_and_other_devices_are_left_alone(mesh4):
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    x, w = (dtorch.distribute_tensor(t, mesh4, [Replicate()]) for t in (a, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w).dtype == torch.float64 == (a @ b).dtype          # float64 is never cast
        assert (x.float() @ w.float()).dtype == torch.bfloat16
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert (x.float() @ w.float()).dtype == torch.float32           # a CPU mesh: "cpu" autocast only
    assert (x.float() @ w.float()).dtype == torch.float32


def test_a_compiled_function_captures_again_when_autocast_changes(mesh4):
    x = dtorch.distribute_tensor(torch.randn(4, 6), mesh4, [Shard(0)])
    w = dtorch.distribute_tensor(torch.randn(6, 3), mesh4, [Replicate()])
    step = dtorch.compile(lambda a, b: a @ b)
    plain = step(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = step(x, w)
        again = step(x, w)
    assert plain.dtype == torch.float32 and cast.dtype == again.dtype == torch.bfloat16
    assert step(x, w).dtype == torch.float32 and step.captures == 2
    torch.testing.assert_close(again.to_torch(), (x.to_torch().bfloat16() @ w.to_torch().bfloat16()))
