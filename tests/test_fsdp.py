"""fully_shard's grouped gather (dtorch/nn/fsdp.py, runtime/worker/fsdp_gather.py): a module's
parameters are gathered by one command and one all-gather, their gradients reduce-scattered by
one collective, and training equals torch's on every mesh, with uneven shapes, tp-sharded
weights, a frozen parameter and two dtypes in one module."""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard
from dtorch.errors import RemoteError
from dtorch.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from dtorch.runtime import protocol
from dtorch.runtime.controller import session

pytestmark = pytest.mark.timeout(120)


class Block(torch.nn.Module):
    """Uneven sizes over 2 and 4 ranks (13, 7, 5), a norm, and a float64 head."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(7, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.down = torch.nn.Linear(13, 5)
        self.head = torch.nn.Linear(5, 7, dtype=torch.float64)

    def forward(self, x):
        h = self.down(self.norm(torch.relu(self.up(x))))
        return self.head(h.double()).float()


def _models(mesh, tp: bool, freeze: bool):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(Block(), Block())
    if freeze:
        for block in reference:
            block.head.requires_grad_(False)
    model = dtorch.distribute_module(_copy(reference), mesh)
    if tp:
        parallelize_module(model, mesh, {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}, tp_dim="tp")
    for block in model:
        fully_shard(block, mesh.mesh_dim_names[0])
    fully_shard(model, mesh.mesh_dim_names[0])
    return reference, model


def _copy(module):
    import copy
    return copy.deepcopy(module)


@contextlib.contextmanager
def _commands():
    """The commands the controller is asked to send (a spy on submit; the workers still run them)."""
    controller = session.controller()
    sent, submit = [], controller.submit

    def spy(command_type, *fields, **kwargs):
        sent.append((command_type, fields[2] if command_type is protocol.RunOp else None))
        return submit(command_type, *fields, **kwargs)
    controller.submit = spy
    try:
        yield sent
    finally:
        del controller.submit


@pytest.mark.parametrize("layout", ["fsdp4", "fsdp2xtp2", "frozen head"])
def test_training_with_grouped_gathers_equals_torch(layout, session):
    """3 AdamW steps: the same losses and parameters as torch. On fsdp2 x tp2 the column-parallel
    bias has no dim tp leaves whole: it is gathered by an ordinary redistribute beside the group."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2) if layout == "fsdp2xtp2" else (4,),
                                   mesh_dim_names=["fsdp", "tp"] if layout == "fsdp2xtp2" else ["fsdp"])
    reference, model = _models(mesh, tp=layout == "fsdp2xtp2", freeze=layout == "frozen head")
    assert model[0].up.weight.placements[0] == Shard(0 if layout != "fsdp2xtp2" else 1)
    optimizer = dtorch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    expected = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 7, generator=g)
        loss = model(dtorch.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))).pow(2).mean()
        theirs = reference(x).pow(2).mean()
        for step in ((loss, optimizer), (theirs, expected)):
            step[0].backward()
            step[1].step()
            step[1].zero_grad()
        torch.testing.assert_close(loss.item(), theirs.item(), rtol=1e-5, atol=1e-7)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(got.placements[0], Shard), name   # the sharded Parameters, not gathered copies
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    if layout == "frozen head":
        assert model[0].head.weight.grad is None


def test_a_module_gathers_its_parameters_with_one_command(mesh4):
    """Each fully-sharded module's forward sends one gather command per (mesh, dtype) of its
    parameters, not a redistribute per parameter; so does its backward's reduce-scatter (no
    command at all: the gather's recorded dual)."""
    _, model = _models(mesh4, tp=False, freeze=False)
    x = dtorch.randn(6, 7, device_mesh=mesh4, placements=[Shard(0)])
    with _commands() as sent:
        loss = model(x).sum()
    gathers = [op for kind, op in sent if op == "fully_shard (all-gather)"]
    assert len(gathers) == 4, sent   # each block: its float32 parameters, its float64 head
    assert not any(kind is protocol.Redistribute for kind, _ in sent)
    loss.backward()
    assert model[0].up.weight.grad.placements == (Shard(0),)


def test_parameters_stay_the_shards_when_copies_are_kept_for_backward(mesh4):
    """reshard_after_forward=False keeps the gathered copies for backward instead of gathering
    them again; the module still hands back its Parameters after forward (before, it kept the
    copies in their place, and the next forward treated a copy as the shard)."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    model = fully_shard(dtorch.distribute_module(_copy(reference), mesh4), "dp", reshard_after_forward=False)
    optimizer = dtorch.optim.SGD(model.parameters(), lr=0.1)
    expected = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 7)
        loss = model(dtorch.distribute_tensor(x, mesh4, [Shard(0)])).sum()
        assert all(p.placements == (Shard(0),) for p in model.parameters())
        theirs = reference(x).sum()
        for step in ((loss, optimizer), (theirs, expected)):
            step[0].backward()
            step[1].step()
            step[1].zero_grad()
        torch.testing.assert_close(loss.item(), theirs.item(), rtol=1e-5, atol=1e-6)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


def test_a_failed_parameter_fails_the_read_not_the_gather(mesh4):
    """A parameter whose value failed on the workers (an index out of range) still joins the
    group's all-gather with zeros on its ranks, so no peer waits; the failure comes back at the
    read, naming the op and the line, and the session goes on."""
    layer = fully_shard(dtorch.distribute_module(torch.nn.Linear(4, 8), mesh4), "dp")
    table = dtorch.randn(8, 4, device_mesh=mesh4, placements=[Replicate()])
    rows = dtorch.tensor(torch.tensor([0, 1, 2, 3, 4, 5, 6, 99]), device_mesh=mesh4, placements=[Replicate()])
    with dtorch.no_grad():
        broken = table[rows]   # fails on the workers only: the controller never sees the indices
        layer.weight.copy_(broken.redistribute(placements=layer.weight.placements))
    out = layer(dtorch.ones(2, 4, device_mesh=mesh4, placements=[Shard(0)]))
    with pytest.raises(RemoteError, match="index"):
        out.to_torch()
    assert dtorch.ones(3, device_mesh=mesh4, placements=[Shard(0)]).sum().item() == 3.0


class _Pair(torch.nn.Module):
    """`b.weight = a.weight` (a tie across two blocks), an unused layer, a learnable 0-D scale."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.unused = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def test_shared_unused_and_0d_parameters_train_as_in_torch(mesh4):
    """Found by a probe of the grouped gather: a Parameter two separately fully-sharded blocks
    share stayed two Parameters (each got part of the gradient); a parameter forward never used
    got a zero gradient, which AdamW's weight decay then moved (torch leaves it None and skips
    it); a 0-D parameter could not be sharded ("S(0) names a dim outside a 0-D tensor")."""
    torch.manual_seed(0)
    reference = _Pair()
    model = dtorch.distribute_module(_copy(reference), mesh4)
    for block in (model.a, model.b, model):
        fully_shard(block, "dp")
    assert model.a.weight is model.b.weight and len(list(model.parameters())) == len(list(reference.parameters()))
    assert model.scale.placements == (Replicate(),)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    expected = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    for _ in range(2):
        x = torch.randn(4, 4)
        model(dtorch.distribute_tensor(x, mesh4, [Shard(0)])).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        assert model.unused.weight.grad is None
        torch.testing.assert_close(model.a.weight.grad.to_torch(), reference.a.weight.grad)
        optimizer.step()
        expected.step()
        optimizer.zero_grad()
        expected.zero_grad()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU()),
                               torch.nn.Sequential(torch.nn.Linear(16, 5), torch.nn.Tanh()))


def _sharded(reference, mesh, policy=None):
    model = dtorch.distribute_module(_copy(reference), mesh)
    for block in model:
        fully_shard(block, "dp", mp_policy=policy)
    return fully_shard(model, "dp", mp_policy=policy)


def _train_steps(model, batches, mesh):
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        loss = model(dtorch.distribute_tensor(x, mesh, [Shard(0)])).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_mixed_precision_policy_gathers_in_param_dtype(mesh4):
    """fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), torch's
    own class or dtorch's: the gathered copies are bfloat16 (the cast rides in the gather, half the
    bytes), inputs are cast, gradients come back float32 onto float32 parameters; the same math
    as casting the gathered float32 copies (dtorch.nn.mixed_precision after fully_shard), so the
    losses and parameters are equal to it bit for bit, and near torch's float32 training."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    reference = _mlp()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(8, 6, generator=g) for _ in range(3)]
    policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _sharded(reference, mesh4, policy)
    seen = []
    ours[0][0].register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, args[0].dtype)))
    cast_after = dtorch.nn.mixed_precision(_sharded(reference, mesh4), torch.bfloat16)
    losses = _train_steps(ours, batches, mesh4)
    assert seen[0] == (torch.bfloat16, torch.bfloat16)
    assert losses == _train_steps(cast_after, batches, mesh4)
    for got, want in zip(ours.parameters(), cast_after.parameters()):
        assert got.dtype == torch.float32 and torch.equal(got.to_torch(), want.to_torch())
    expected = _train_steps(_sharded(reference, mesh4), batches, mesh4)
    assert losses == pytest.approx(expected, rel=2e-2)
    # FSDP2's default reduce_dtype (param_dtype: a bfloat16 reduce-scatter) and an output dtype
    loose = _sharded(reference, mesh4, dtorch.nn.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       output_dtype=torch.float32))
    assert loose(dtorch.distribute_tensor(batches[0], mesh4, [Shard(0)])).dtype == torch.float32
    assert _train_steps(loose, batches, mesh4) == pytest.approx(expected, rel=2e-2)
    assert all(p.dtype == torch.float32 and p.placements == (Shard(0),) for p in loose.parameters())


def test_a_forward_that_raises_hands_the_parameters_back(mesh4):
    """Found by a probe: fully_shard's (and mixed_precision's) forward hooks put the Parameters
    back only after a forward that returned; one that raised left the gathered copies in their
    place (model.parameters() and state_dict() gave them), and the next forward failed
    ("'Replicate' object has no attribute 'dim'"). The hooks now run always."""
    reference = _mlp()
    policy = dtorch.nn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for model in (_sharded(reference, mesh4), _sharded(reference, mesh4, policy),
                  dtorch.nn.mixed_precision(_sharded(reference, mesh4), torch.bfloat16)):
        with pytest.raises(dtorch.DTorchError):
            model(dtorch.ones(4, 7, device_mesh=mesh4, placements=[Shard(0)]))   # 7 features, not 6
        assert all(p.placements == (Shard(0),) and p.dtype == torch.float32 for p in model.parameters())
        x = torch.randn(4, 6)
        out = model(dtorch.distribute_tensor(x, mesh4, [Shard(0)]))
        torch.testing.assert_close(out.to_torch().float(), reference(x), rtol=2e-2, atol=2e-2)


class _Unusual(torch.nn.Module):
    """Inputs by keyword and in a list, a 0-D scale, a namedtuple output and a dict output."""
    Out = collections.namedtuple("Out", "y z")

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 5)
        self.scale = torch.nn.Parameter(torch.tensor(0.75))

    def forward(self, pair, *, x):
        y = self.linear(x + pair[0]) * self.scale
        return self.Out(y, {"sum": y.sum(-1)})


def test_a_policy_casts_at_any_depth_and_whole_parameters_too(mesh4, session):
    """A probe of mp_policy found the inputs cast only at the top level of the positional
    arguments (a keyword input met bfloat16 weights in float32: a dtype error), a namedtuple
    output failing to cast and a dict output left uncast, and the parameters fully_shard leaves
    whole (a 0-D scale; every one when the fsdp dim has size 1) never cast, so the arithmetic
    was not mixed_precision's. And a policy of the wrong type was silently ignored."""
    torch.manual_seed(0)
    reference = _Unusual()
    x, shift = torch.randn(4, 6), torch.randn(4, 6)
    policy = dtorch.nn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            output_dtype=torch.float32)
    flat = dtorch.init_device_mesh("cpu", (4, 1), mesh_dim_names=["dp", "fsdp"])
    for mesh, dim in ((mesh4, "dp"), (flat, "fsdp")):
        ours = fully_shard(dtorch.distribute_module(_copy(reference), mesh), dim, mp_policy=policy)
        cast_after = dtorch.nn.mixed_precision(fully_shard(dtorch.distribute_module(_copy(reference), mesh), dim),
                                               torch.bfloat16)
        results = []
        # float32 inputs for the policy to cast; bfloat16 ones for mixed_precision, which casts
        # only the top-level positional arguments of each module
        for model, dtype in ((ours, torch.float32), (cast_after, torch.bfloat16)):
            inputs = [dtorch.distribute_tensor(t.to(dtype), mesh, [Shard(0), Replicate()][:mesh.ndim])
                      for t in (x, shift)]
            out = model([inputs[1]], x=inputs[0])
            y = out.y.float()
            y.pow(2).sum().backward()
            results.append((out, y.to_torch(), model.linear.weight.grad.to_torch(), model.scale.grad.to_torch()))
        (out, *mine), (_, *theirs) = results
        assert isinstance(out, _Unusual.Out) and out.y.dtype == torch.float32 and out.z["sum"].dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), dim
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fully_shard(dtorch.distribute_module(torch.nn.Linear(2, 2), mesh4), "dp", mp_policy=torch.bfloat16)
    with pytest.raises(ValueError, match="floating-point"):
        fully_shard(dtorch.distribute_module(torch.nn.Linear(2, 2), mesh4), "dp",
                    mp_policy=dtorch.nn.MixedPrecisionPolicy(param_dtype=torch.int32))
