"""Public models, used as their own docs use them, on dtorch meshes: forward, one training step
and no blocking read, each against the same steps in plain torch (issue 42, "Tests").

For every model in models.ZOO and every layout it has (dp2: the batch Shard(0) over 2 ranks,
parameters Replicate via dtorch.distribute_module; tp2: its plan through dtorch.nn.parallelize_module,
inputs Replicate), three checks:
  forward  the output and the loss equal torch's;
  train    loss.backward() gives torch's gradient for every parameter, and one SGD step gives
           torch's parameters and buffers (read back from model.state_dict());
  no_read  forward and backward under dtorch.set_sync_debug_mode("error"): nothing in them waits
           on the workers.
Llama also runs tp2 with torch's own styles (torch.distributed.tensor.parallel) in dtorch's
parallelize_module. torch's parallelize_module itself runs each rank's own code (the calling
rank's shard, its process group), which a single controller has none of: on a dtorch mesh it
refuses and names dtorch's call with the same plan (the last test here)."""
from __future__ import annotations

import copy

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import parallelize_module

from .known_gaps import KNOWN_GAPS
from .models import ZOO, missing

RTOL, ATOL, SCALED_ATOL = 1e-4, 1e-5, 1e-4
LEARNING_RATE = 0.5      # large, so that a gradient that is off shows in the updated parameters
TORCH_STYLE_LAYOUTS = {"llama": ["tp2-torch-styles"]}
UNAVAILABLE = {
    "torchvision": "PyPI's torchvision wheels are CUDA builds: beside torch's CPU build their _C.so needs "
                   "libtorch_cuda.so, and `import torchvision` fails with 'operator torchvision::nms does not "
                   "exist'. bash .ci/zoo_vision.sh runs these models in a venv of their own (torch 2.14.1 and "
                   "torchvision 0.29.1, as PyPI pairs them)",
    "timm": "timm imports torchvision.ops at import (timm/layers/create_norm.py), and torchvision cannot be "
            "installed beside torch's CPU build. bash .ci/zoo_vision.sh runs these models in a venv of their own",
}


def _cases(check: str):
    for spec in ZOO:
        for layout in spec.layouts + TORCH_STYLE_LAYOUTS.get(spec.name, []):
            marks = []
            why = missing(spec.library)
            if why:
                fix = UNAVAILABLE.get(spec.library, "the test extra installs it: pip install -e '.[test]'")
                marks.append(pytest.mark.skip(reason=f"{why}; {fix}"))
            gap = KNOWN_GAPS.get((spec.name, layout, check))
            if gap:
                error, reason = gap
                marks.append(pytest.mark.xfail(strict=True, raises=error, reason=reason))
            yield pytest.param(spec, layout, id=f"{spec.name}-{layout}", marks=marks)


def _torch_plan(plan: dict) -> dict:
    from torch.distributed.tensor import parallel
    return {key: getattr(parallel, type(style).__name__)() for key, style in plan.items()}


def _on_mesh(spec, layout, meshes):
    """(torch reference, the same model on the mesh, torch batch, batch on the mesh)."""
    torch.manual_seed(0)
    reference = spec.build()
    model = copy.deepcopy(reference)
    mesh = meshes["dp2" if layout == "dp2" else "tp2"]
    if layout == "dp2":
        assert dtorch.distribute_module(model, mesh) is model
    elif layout == "tp2":
        parallelize_module(model, mesh, spec.tp_plan, tp_dim="tp")
    else:
        assert layout == "tp2-torch-styles", layout
        parallelize_module(model, mesh, _torch_plan(spec.tp_plan), tp_dim="tp")
    batch = spec.inputs(torch.Generator().manual_seed(1))
    placements = [Shard(0)] if layout == "dp2" else [Replicate()]
    placed = {key: dtorch.distribute_tensor(value, mesh, placements) for key, value in batch.items()}
    return reference, model, batch, placed


def _read(value):
    assert isinstance(value, dtorch.DTensor), f"expected a DTensor on the mesh, got {type(value).__name__}"
    return value.to_torch()


def _close(got, expected, what: str) -> None:
    """Within float32 rounding of the tensor's own scale: a sum split across ranks (a batch norm's
    statistics, a gradient over a sharded batch) adds in another order, and its error grows with
    the values' size, so an element near zero in a tensor of large ones gets the large ones' atol.
    (torchvision's ResNet, batch 4 through batch norms down to 1x1: torch's own float32 gradients
    are 6.6e-5 of their scale off float64, dtorch's dp2 ones 5.3e-5.)"""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=max(ATOL, SCALED_ATOL * scale),
                               msg=lambda message: f"{what}: {message}")


def _check_outputs(spec, model, reference, batch, placed):
    output, loss = spec.run(model, placed)
    expected_output, expected_loss = spec.run(reference, batch)
    _close(_read(output), expected_output.detach(), "output")
    _close(_read(loss), expected_loss.detach(), "loss")
    return loss, expected_loss


@pytest.mark.parametrize("spec, layout", _cases("forward"))
def test_forward(spec, layout, zoo_meshes):
    reference, model, batch, placed = _on_mesh(spec, layout, zoo_meshes)
    _check_outputs(spec, model, reference, batch, placed)


@pytest.mark.parametrize("spec, layout", _cases("train"))
def test_training_step(spec, layout, zoo_meshes):
    reference, model, batch, placed = _on_mesh(spec, layout, zoo_meshes)
    loss, expected_loss = _check_outputs(spec, model, reference, batch, placed)
    loss.backward()
    expected_loss.backward()
    for (name, parameter), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        if expected.grad is None:
            assert parameter.grad is None, f"{name} has a gradient; torch's has none"
            continue
        assert parameter.grad is not None, f"no gradient reached {name}: torch's is {expected.grad.norm():.3g} in norm"
        _close(_read(parameter.grad), expected.grad, f"{name}.grad")
    dtorch.optim.SGD(model.parameters(), lr=LEARNING_RATE).step()
    torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE).step()
    expected_state = reference.state_dict()
    for name, value in model.state_dict().items():
        got = value.to_torch() if isinstance(value, dtorch.DTensor) else value
        _close(got, expected_state[name], f"{name} after one SGD step")


@pytest.mark.parametrize("spec, layout", _cases("no_read"))
def test_no_blocking_read(spec, layout, zoo_meshes, sync_debug_error):
    """Nothing inside forward or backward waits on the workers (set_sync_debug_mode("error")
    raises BlockingReadError at the line of any read)."""
    _, model, _, placed = _on_mesh(spec, layout, zoo_meshes)
    before = dtorch.stats()["blocking_reads"]
    _, loss = spec.run(model, placed)
    loss.backward()
    # counted too: library code that catches the BlockingReadError (a broad `except Exception`)
    # and goes another way would otherwise hide the read
    assert dtorch.stats()["blocking_reads"] == before, "a blocking read inside forward or backward was caught"


def test_the_zoo_has_what_issue_42_asks():
    """At least 15 models that run here, from transformers and diffusers at least; decoders
    trained through labels=, an encoder-decoder, a UNet with a tensor timestep, a DiT, a CNN with
    BatchNorm; and a tensor-parallel plan for every transformer-style model."""
    runnable = [spec for spec in ZOO if not missing(spec.library)]
    assert len(runnable) >= 15, [spec.name for spec in runnable]
    assert {"transformers", "diffusers"} <= {spec.library for spec in runnable}
    names = {spec.name for spec in runnable}
    assert {"gpt2", "llama", "qwen2", "mistral", "phi3", "bert", "t5", "bart", "vit", "resnet", "unet2d",
            "unet2d_condition", "dit", "autoencoder_kl"} <= names
    assert all(spec.tp_plan for spec in runnable if spec.name in {"gpt2", "llama", "bert", "t5", "vit", "dit"})


def test_torchs_own_parallelize_module_names_dtorchs_call(zoo_meshes):
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
    spec = next(spec for spec in ZOO if spec.name == "llama")
    model = spec.build()
    with pytest.raises(dtorch.MeshError) as info:
        torch_parallelize_module(model, zoo_meshes["tp2"], _torch_plan(spec.tp_plan))
    message = str(info.value)
    assert "get_coordinate" in message and "dtorch.nn.parallelize_module(model, mesh, plan)" in message
