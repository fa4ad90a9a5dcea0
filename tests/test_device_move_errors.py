"""Moving a DTensor to another device, every spelling: the refusal says what to write (a mesh of
that device, or a read then torch's move), at the user's line, and never suggests an unrelated op
("x.cuda() ... Nearest supported: cummax" was the report). On the session fixture's CPU mesh."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Shard

HERE = __file__


@pytest.mark.parametrize("spelling, call", [
    ("x.cuda()", lambda x: x.cuda()),
    ("x.cuda()", lambda x: x.cuda(0, non_blocking=True)),
    ("x.to('cuda')", lambda x: x.to("cuda")),
    ("torch.Tensor.cuda(x)", lambda x: torch.Tensor.cuda(x)),
    ("x.xpu()", lambda x: x.xpu()),
    ("torch.Tensor.cpu(x)", lambda x: torch.Tensor.cpu(x)),
])
def test_a_move_to_another_device_says_what_to_write(mesh4, spelling, call):
    x = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError) as refused:
        call(x)
    message = str(refused.value)
    assert "Nearest supported" not in message, message
    assert message.startswith(spelling) and f"{HERE}:" in message, message
    device = "cpu" if "cpu" in spelling else "xpu" if "xpu" in spelling else "cuda"
    assert "mesh" in message and "x.to_torch()" in message and device in message, message


def test_torch_tensor_cuda_points_at_dtensor_s_own_method(mesh4):
    x = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError, match=r"write x\.cuda\(\), DTensor's own method.*"
                                                        r"init_device_mesh\('cuda'.*x\.to_torch\(\)\.cuda\(\)"):
        torch.Tensor.cuda(x)
    assert x.cpu() is x   # on its own device, the method is x itself


def test_pin_memory_says_there_is_nothing_here_to_pin(mesh4):
    x = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError, match=r"x\.pin_memory\(\) at .*no memory in this process.*"
                                                        r"x\.to_torch\(\)\.pin_memory\(\)") as refused:
        x.pin_memory()
    assert "Nearest supported" not in str(refused.value)


@pytest.mark.parametrize("spelling, call", [
    ("x.new_ones(..., device='cuda')", lambda x: x.new_ones(4, device="cuda")),
    ("x.new_zeros(..., device='cuda:0')", lambda x: x.new_zeros((2, 2), device=torch.device("cuda", 0))),
    ("x.new_empty(..., device='cuda')", lambda x: x.new_empty(3, device="cuda")),
    ("x.new_full(..., device='cuda')", lambda x: x.new_full((2,), 7.0, device="cuda")),
    ("x.new_tensor(..., device='cuda')", lambda x: x.new_tensor([1.0], device="cuda")),
])
def test_a_new_tensor_on_another_device_type_is_refused(mesh4, spelling, call):
    """These returned a CPU DTensor (new_ones) or raised torch's bare AssertionError (new_tensor,
    "Torch not compiled with CUDA enabled") on a CPU mesh."""
    x = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    with pytest.raises(dtorch.UnsupportedOpError) as refused:
        call(x)
    message = str(refused.value)
    assert message.startswith(spelling) and f"{HERE}:" in message, message
    assert "cuda_mesh" in message and "leave device= out" in message, message


def test_a_new_tensor_on_the_mesh_device_type_is_made_on_the_mesh(mesh4):
    x = dtorch.ones(8, device_mesh=mesh4, placements=[Shard(0)])
    made = [x.new_ones(3, device="cpu"), x.new_zeros(2, device=torch.device("cpu")),
            x.new_full((2,), 5.0, device="cpu")]
    assert all(isinstance(t, dtorch.DTensor) and t.device_mesh == mesh4 for t in made)
    torch.testing.assert_close(made[2].to_torch(), torch.full((2,), 5.0))
    local = x.new_tensor([1.5], device="cpu")   # torch.nn.init's bounds: a plain tensor here
    assert type(local) is torch.Tensor and local.item() == 1.5
