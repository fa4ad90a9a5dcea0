"""Every public constructor's result is a torch.Tensor to torch's own checks (isinstance and
torch.is_tensor: DTensor is a torch.Tensor subclass), and dtorch.Tensor takes DTorch's (and
torch.Tensor's) constructor forms (dtorch/dtensor/factories.py), each compared with torch.Tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard
from support import assert_same

R = Replicate()


def _constructors(mesh):
    """(name, zero-argument call) for each public way to make a DTensor."""
    on = dict(device_mesh=mesh, placements=[Shard(0)] + [R] * (mesh.ndim - 1))
    x = dtorch.randn(5, 3, **on)
    local = torch.randn(5, 3)
    return {
        "zeros": lambda: dtorch.zeros(5, 3, **on), "ones": lambda: dtorch.ones((5, 3), **on),
        "empty": lambda: dtorch.empty(5, 3, **on), "full": lambda: dtorch.full((5, 3), 2.0, **on),
        "rand": lambda: dtorch.rand(5, 3, **on), "randn": lambda: dtorch.randn(5, 3, **on),
        "randint": lambda: dtorch.randint(0, 9, (5, 3), **on), "arange": lambda: dtorch.arange(7, **on),
        "linspace": lambda: dtorch.linspace(0, 1, 7, **on), "eye": lambda: dtorch.eye(5, 3, **on),
        "tensor": lambda: dtorch.tensor(local, **on), "tensor(list)": lambda: dtorch.tensor([1, 2, 3]),
        "distribute_tensor": lambda: dtorch.distribute_tensor(local, mesh, on["placements"]),
        "zeros_like": lambda: dtorch.zeros_like(x), "ones_like": lambda: dtorch.ones_like(x),
        "empty_like": lambda: dtorch.empty_like(x), "full_like": lambda: dtorch.full_like(x, 3.0),
        "rand_like": lambda: dtorch.rand_like(x), "randn_like": lambda: dtorch.randn_like(x),
        "torch.zeros_like": lambda: torch.zeros_like(x), "torch.full_like": lambda: torch.full_like(x, 1.0),
        "Tensor(data)": lambda: dtorch.Tensor(local, **on), "Tensor(sizes)": lambda: dtorch.Tensor(5, 3, **on),
        "Tensor()": lambda: dtorch.Tensor(), "nn.Parameter": lambda: dtorch.nn.Parameter(dtorch.randn(5, 3, **on)),
        "new_tensor": lambda: x.new_tensor([1.0, 2.0]),
    }


def test_every_public_constructor_makes_a_torch_tensor(mesh):
    for name, make in _constructors(mesh).items():
        made = make()
        assert isinstance(made, dtorch.DTensor), name
        assert isinstance(made, torch.Tensor), name
        assert torch.is_tensor(made), name
        assert isinstance(made, dtorch.Tensor), name
        assert type(made) in (dtorch.DTensor, dtorch.nn.Parameter), (name, type(made))


def test_tensor_forms_match_torch_tensor(mesh4):
    for args in [(), ([[1, 2], [3, 4]],), ((1, 2, 3),), (np.array([1, 2, 3]),), (torch.tensor([1, 2]),),
                 (torch.randn(2, 3),), (np.float32(2.5) * np.ones((2, 2), dtype=np.float32),)]:
        got, want = dtorch.Tensor(*args), torch.Tensor(*args)
        assert got.device_mesh.shape == (1,)   # no mesh: a one-device mesh
        assert_same(got.to_torch(), want)
    for sizes in [(2, 3), (torch.Size([2, 3]),), (0,), (4,)]:
        got, want = dtorch.Tensor(*sizes), torch.Tensor(*sizes)
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    placed = dtorch.Tensor(torch.randn(6, 4).double(), device_mesh=mesh4, placements=[Shard(1)])
    assert placed.placements == (Shard(1),) and placed.dtype == torch.float64 and placed.device_mesh == mesh4
    sized = dtorch.Tensor(6, 4, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True)
    assert sized.shape == (6, 4) and sized.placements == (Shard(0),) and sized.requires_grad
    assert dtorch.Tensor([1, 2], dtype=torch.int32).dtype == torch.int32


def test_tensor_of_a_dtensor_is_that_tensor_moved_or_cast_if_asked(mesh4):
    value = torch.randn(8, 3)
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)])
    assert dtorch.Tensor(x) is x                       # DTorch's copy constructor shares the tensor
    moved = dtorch.Tensor(x, placements=[R])
    assert moved.placements == (R,) and torch.equal(moved.to_torch(), value)
    assert dtorch.Tensor(x, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(dtorch.DTorchError, match="device_mesh="):
        dtorch.Tensor(x, device="cpu")


def test_tensor_refuses_mixed_arguments_as_torch_does(session):
    with pytest.raises(TypeError, match="sizes"):
        dtorch.Tensor(2, 3.0)
    with pytest.raises(TypeError):
        torch.Tensor(2, 3.0)
