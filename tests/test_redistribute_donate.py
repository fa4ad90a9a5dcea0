"""Donation: a P -> R of a temporary (`(a @ b).redistribute(...)`) reduces in place on the
workers instead of copying first (protocol's Redistribute.donate, kernels.apply_steps). What
the controller or the workers still read must never change: a held source, a view's base, a
tensor autograd knows."""
import pytest
import torch

import dtorch
from dtorch.spec.placements import Partial, Replicate, Shard
from dtorch.runtime import protocol as wire
from support import assert_same

R = Replicate()


@pytest.fixture
def donations(monkeypatch, mesh4):
    """The `donate` field of every Redistribute command submitted during the test."""
    controller = dtorch.zeros(1, device_mesh=mesh4)._controller
    seen, submit = [], controller.submit

    def spy(command_type, *fields, **kwargs):
        if command_type is wire.Redistribute:
            seen.append(fields[-1])
        return submit(command_type, *fields, **kwargs)
    monkeypatch.setattr(controller, "submit", spy)
    return seen


def test_a_temporary_is_reduced_in_place_and_reads_right(mesh4, donations):
    value = torch.randn(8, 6)
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Partial()])
    assert_same((x * 2).redistribute(placements=[R]).to_torch(), value * 2)
    assert donations == [True]
    assert_same(x.to_torch(), value)   # the temporary's input is untouched


def test_a_held_source_is_copied_and_stays_partial(mesh4, donations):
    value = torch.randn(8, 6)
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Partial()])
    y = x.redistribute(placements=[R])
    z = x.redistribute(placements=[Shard(0)])   # x still holds its parts: the sum again
    assert donations == [False, False]
    assert_same(y.to_torch(), value)
    assert_same(z.to_torch(), value)
    assert_same(x.redistribute(placements=[R]).to_torch(), value)


def test_a_temporary_view_leaves_its_base_alone(mesh4, donations):
    """The controller donates the view (a temporary); the worker sees that its storage is
    shared with the base and copies."""
    value = torch.randn(8, 6)
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Partial()])
    assert_same(x.view(48).redistribute(placements=[R]).to_torch(), value.view(48))
    assert donations == [True]
    assert_same(x.redistribute(placements=[Shard(1)]).to_torch(), value)


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_donated_selection_keeps_nan(mesh4, donations, op):
    value = torch.randn(6, 5)
    value[1, 2] = float("nan")
    out = dtorch.tensor(value, device_mesh=mesh4, placements=[Partial(op)]).redistribute(placements=[R])
    assert donations == [True]
    assert_same(out.to_torch(), value)


def test_an_earlier_steps_buffer_is_reduced_in_place(mesh22):
    """[S(0), P] -> [R, R]: the all-gather's output is private, the held source is not touched."""
    value = torch.randn(6, 5)
    x = dtorch.tensor(value, device_mesh=mesh22, placements=[Shard(0), Partial()])
    assert_same(x.redistribute(placements=[R, R]).to_torch(), value)
    assert_same(x.redistribute(placements=[R, Shard(0)]).to_torch(), value)


def test_a_tensor_autograd_knows_is_never_donated(mesh4, donations):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    da = dtorch.tensor(a, device_mesh=mesh4, placements=[Shard(1)]).requires_grad_()
    db = dtorch.tensor(b, device_mesh=mesh4, placements=[Shard(0)])
    out = (da @ db).redistribute(placements=[R])
    assert donations == [False]
    (out * out).sum().backward()
    ta = a.clone().requires_grad_()
    ((ta @ b) ** 2).sum().backward()
    assert_same(da.grad.to_torch(), ta.grad)


def test_a_redistribute_without_donate_still_decodes():
    """The field came without a version bump: a row that lacks it reads as donate=False."""
    steps = ((0, Partial(), R),)
    row = (wire.OPCODE[wire.Redistribute], 0, 3, 1, 0, (4, 6), "float32", (Partial(),), steps, False)
    (command,) = wire.decode_batch(wire.Batch(0, 1), wire.pack([row]))
    assert command.donate is False and command.steps == steps
    with pytest.raises(Exception, match="malformed Redistribute"):
        wire.decode_batch(wire.Batch(0, 1), wire.pack([row[:-3]]))   # fields without a default missing
