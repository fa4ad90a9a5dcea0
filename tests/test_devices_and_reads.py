"""Devices follow torch DTensor's conventions and reads are only ever explicit (issue 42, 2.):
`x.to(x.device)` keeps a DTensor with its history, `set_sync_debug_mode` names every blocking
read, and `load_state_dict` copies values instead of sharing the caller's tensors."""
import asyncio
import copy
import warnings

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from support import assert_same

HERE = "test_devices_and_reads.py:"


@pytest.fixture
def sync_debug():
    """Leaves the process in the default mode whatever the test does."""
    yield dtorch.set_sync_debug_mode
    dtorch.set_sync_debug_mode("default")


class PositionalLM(torch.nn.Module):
    """GPT-2's embedding code, as transformers writes it: the position embeddings are moved to the
    token embeddings' device before the sum (modeling_gpt2.py)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = torch.nn.Embedding(11, 8), torch.nn.Embedding(6, 8), torch.nn.Linear(8, 11)

    def forward(self, input_ids):
        inputs_embeds = self.wte(input_ids)
        position_ids = torch.arange(input_ids.shape[-1], device=inputs_embeds.device).unsqueeze(0)
        position_embeds = self.wpe(position_ids)
        hidden = inputs_embeds + position_embeds.to(inputs_embeds.device)
        logits = self.head(hidden)
        labels = input_ids.to(logits.device)   # transformers' loss code
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def sgd_step(model, loss, lr=0.5):
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["S(0)", "R"])
def test_to_device_in_model_code_keeps_the_gradient(mesh4, placement, sync_debug):
    """The defect: `.to(x.device)` read the tensor here, so wpe never got a gradient (silently)."""
    torch.manual_seed(0)
    reference = PositionalLM()
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    ids = torch.randint(0, 11, (4, 6))
    sync_debug("error")   # forward and backward never wait on a worker
    loss = model(dtorch.tensor(ids, device_mesh=mesh4, placements=[placement]))
    sgd_step(model, loss)
    sync_debug("default")
    expected = reference(ids)
    sgd_step(reference, expected)
    assert_same(loss.to_torch(), expected.detach())
    for (_name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert_same(got.to_torch(), want)


def test_every_to_form_of_the_mesh_device_keeps_a_dtensor_with_its_history(mesh22):
    values = torch.randn(4, 6)
    x = dtorch.tensor(values, device_mesh=mesh22, placements=[Shard(0), Shard(1)], requires_grad=True)
    other = dtorch.zeros(2, device_mesh=mesh22, dtype=torch.float64)
    assert x.device == torch.device("cpu") and x.device == other.device
    for same in (x.to(x.device), x.to(other.device), x.to("cpu"), x.to(device="cpu", non_blocking=True), x.cpu()):
        assert same is x
    cast = (x.to(other), x.type_as(other), x.to("cpu", torch.float64), x.to(torch.zeros(1, dtype=torch.float64)))
    for y in cast:
        assert isinstance(y, dtorch.DTensor) and y.dtype == torch.float64 and y.grad_fn is not None
    copied = x.to(x.device, copy=True)
    assert copied is not x and torch.equal(copied.to_torch(), values)
    sum(y.sum() for y in cast).backward()
    assert_same(x.grad.to_torch(), torch.full_like(values, 4.0))


def test_a_device_of_another_type_is_refused_with_what_to_write(mesh4):
    x = dtorch.ones(4, device_mesh=mesh4)
    for call, written in ((lambda: x.to("cuda"), "x.to('cuda')"), (x.cuda, "x.cuda()")):
        with pytest.raises(dtorch.UnsupportedOpError) as info:
            call()
        message = str(info.value)
        assert written in message and HERE in message and "to_torch()" in message and "mesh" in message


def test_modules_accept_their_own_device(mesh4):
    model = dtorch.distribute_module(torch.nn.Linear(3, 2), mesh4)
    weight = model.weight
    assert model.to("cpu") is model and model.cpu() is model and model.to(torch.device("cpu"), torch.float32) is model
    assert model.weight is weight
    with pytest.raises(dtorch.UnsupportedOpError, match="cuda"):
        model.cuda()


def test_reads_of_a_tensor_that_requires_grad_follow_torch(mesh4):
    values = torch.randn(4, 3)
    x = dtorch.tensor(values, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Use tensor.detach\(\).numpy\(\) instead"):
        x.numpy()
    with pytest.raises(RuntimeError, match="requires grad"):
        import numpy
        numpy.asarray(x)
    assert (x.detach().numpy() == values.numpy()).all() and (x.numpy(force=True) == values.numpy()).all()
    read = x.to_torch()   # a plain tensor that does not look attached
    assert type(read) is torch.Tensor and not read.requires_grad and read.grad_fn is None


def test_sync_debug_mode_names_every_blocking_read(mesh4, sync_debug):
    x = dtorch.ones(4, 2, device_mesh=mesh4, placements=[Shard(0)])
    loss = (x * 3).sum()
    sync_debug("error")
    assert dtorch.get_sync_debug_mode() == 2
    reads = {"item()": loss.item, "to_torch()": x.to_torch, "tolist()": x.tolist, "numpy()": x.numpy,
             "bool(x)": lambda: bool(loss), "float(x)": lambda: float(loss), "format(x)": lambda: f"{loss:.2f}"}
    for name, read in reads.items():
        with pytest.raises(dtorch.BlockingReadError) as info:
            read()
        assert name in str(info.value) and HERE in str(info.value)
    assert torch.equal(asyncio.run(x.fetch()), torch.ones(4, 2))   # awaiting never blocks the thread
    sync_debug("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loss.item() == 24.0
    assert len(caught) == 1 and issubclass(caught[0].category, dtorch.BlockingReadWarning)
    assert HERE in str(caught[0].message)
    sync_debug(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loss.item() == 24.0
    with pytest.raises(ValueError, match="'default', 'warn' or 'error'"):
        dtorch.set_sync_debug_mode("loud")


def test_stats_count_blocking_and_implicit_reads(mesh4):
    x = dtorch.ones(4, device_mesh=mesh4, placements=[Shard(0)])
    before = dtorch.stats()
    x.sum().item()                # the caller's own read
    torch.equal(x, x)             # a read dtorch makes on the caller's behalf
    after = dtorch.stats()
    assert after["blocking_reads"] - before["blocking_reads"] == 2
    assert after["implicit_reads"] - before["implicit_reads"] == 1


def _two_models(mesh):
    torch.manual_seed(1)
    source = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    return (dtorch.distribute_module(copy.deepcopy(source), mesh),
            dtorch.distribute_module(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6),
                                                         torch.nn.Linear(6, 2)), mesh), source)


@pytest.mark.parametrize("layout", ["same", "resharded"])
def test_load_state_dict_copies_and_leaves_the_source_independent(mesh4, layout):
    """The defect: dst took src's own worker buffers, so a step on dst changed src (EMA, teacher
    and reference copies), and the caller's dict was unreadable afterwards."""
    src, dst, reference = _two_models(mesh4)
    if layout == "resharded":
        dst[0].weight = dtorch.nn.Parameter(dst[0].weight.redistribute(placements=[Shard(0)]))
    params = list(dst.parameters())
    state = src.state_dict()
    dst.load_state_dict(state)
    assert list(dst.parameters()) == params and all(a is b for a, b in zip(dst.parameters(), params))
    optimizer = dtorch.optim.SGD(dst.parameters(), lr=1.0)
    dst(dtorch.ones(3, 4, device_mesh=mesh4)).sum().backward()
    optimizer.step()
    for (name, value), want in zip(state.items(), reference.state_dict().values()):
        assert_same(value.to_torch(), want)                      # the caller's dict: readable, unchanged
        assert_same(src.state_dict()[name].to_torch(), want)     # and src itself
    assert not torch.equal(dst[0].weight.to_torch(), reference[0].weight.detach())
