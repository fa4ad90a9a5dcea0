"""dtorch.nn against torch.nn: the same weights (read back with state_dict) give the same outputs
on every layout; the Module machinery (registration, state_dict, load_state_dict, conversions,
containers, hooks) behaves as torch's does, and refuses what would fail later with a clear error."""
from __future__ import annotations

import copy

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard, UnsupportedOpError, nn
from dtorch.spec.placements import init_device_mesh

from support import assert_same

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tp2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])


@pytest.fixture(params=["mesh1", "tp2", "mesh22"])
def layout(request):
    """A mesh, and the placements of a (batch, features) input on it (batch over dp where it exists)."""
    mesh = request.getfixturevalue(request.param)
    batch = [Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names]
    return mesh, batch


def torch_copy(module: nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    reference.load_state_dict({k: v.to_torch() for k, v in module.state_dict().items()})
    return reference


def run_both(module, reference, x: torch.Tensor, mesh, placements):
    out = module(dtorch.tensor(x, device_mesh=mesh, placements=placements))
    with torch.no_grad():
        expected = torch_copy(module, reference)(x)
    return out, expected


LINEARS = [nn.Linear, nn.ColumnParallelLinear, nn.RowParallelLinear, nn.ColumnParallelLinearWithReplicateOutput,
           nn.ColumnParallelLinearWithReplicateInputOutput, nn.RowParallelLinearWithReplicateOutput,
           nn.ReplicateParallelLinear]


@pytest.mark.parametrize("cls", LINEARS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_variants_match_torch(cls, bias, layout):
    mesh, batch = layout
    layer = cls(10, 6, bias=bias, device_mesh=mesh)
    out, expected = run_both(layer, torch.nn.Linear(10, 6, bias=bias), torch.randn(5, 10), mesh, batch)
    assert_same(out.to_torch(), expected)


def test_tensor_parallel_placements_follow_megatron(mesh22):
    tp = 1
    col = nn.ColumnParallelLinear(8, 6, device_mesh=mesh22)
    row = nn.RowParallelLinear(6, 8, device_mesh=mesh22)
    assert col.weight.placements[tp] == Shard(0) and col.bias.placements[tp] == Shard(0)
    assert row.weight.placements[tp] == Shard(1) and row.bias.placements[tp] == Replicate()
    x = dtorch.randn(4, 8, device_mesh=mesh22, placements=[Shard(0), Replicate()])
    hidden = col(x)
    assert hidden.placements == (Shard(0), Shard(1))
    out = row(hidden)
    assert out.placements == (Shard(0), Partial("sum"))   # no collective until someone needs one
    assert (nn.RowParallelLinearWithReplicateOutput(6, 8, device_mesh=mesh22)(hidden).placements
            == (Shard(0), Replicate()))


def test_a_mesh_without_the_tp_name_gives_a_replicated_layer(mesh4):
    layer = nn.ColumnParallelLinear(8, 4, device_mesh=mesh4)   # mesh4's only dim is "dp"
    assert layer.tp_dim is None and layer.weight.placements == (Replicate(),)
    assert nn.ColumnParallelLinear(8, 4, device_mesh=mesh4, tp_dim="dp").weight.placements == (Shard(0),)


def test_initialization_is_torchs_and_the_same_on_every_layout(tp2, mesh1):
    dtorch.manual_seed(3)
    sharded = nn.ColumnParallelLinear(64, 32, device_mesh=tp2).weight.to_torch()
    dtorch.manual_seed(3)
    whole = nn.Linear(64, 32, device_mesh=mesh1).weight.to_torch()
    assert_same(sharded, whole, exact=True)
    bound = 1 / 64 ** 0.5
    assert sharded.abs().max() <= bound and sharded.abs().max() > 0.9 * bound


@pytest.mark.parametrize("shard_type", ["dim", "vocab"])
def test_embedding_matches_torch(shard_type, layout):
    mesh, batch = layout
    layer = nn.Embedding(11, 6, padding_idx=2, device_mesh=mesh, tp_shard_type=shard_type)
    ids = torch.tensor([[1, 2, 10], [0, 5, 2]])
    out = layer(dtorch.tensor(ids, device_mesh=mesh, placements=batch))
    expected = torch_copy(layer, torch.nn.Embedding(11, 6, padding_idx=2))(ids)
    assert_same(out.to_torch(), expected.detach())
    assert (layer.weight.to_torch()[2] == 0).all()
    replicated = nn.EmbeddingWithReplicateOutput(11, 6, device_mesh=mesh, tp_shard_type=shard_type)
    assert all(not p.is_partial()
               for p in replicated(dtorch.tensor(ids, device_mesh=mesh, placements=batch)).placements)


@pytest.mark.parametrize("make, reference", [
    (lambda mesh: nn.LayerNorm(6, device_mesh=mesh), torch.nn.LayerNorm(6)),
    (lambda mesh: nn.LayerNorm(6, bias=False, device_mesh=mesh), torch.nn.LayerNorm(6, bias=False)),
    (lambda mesh: nn.RMSNorm(6, eps=1e-6, device_mesh=mesh), torch.nn.RMSNorm(6, eps=1e-6)),
    (lambda mesh: nn.RMSNorm([3, 6], device_mesh=mesh), torch.nn.RMSNorm([3, 6])),
], ids=["layer_norm", "layer_norm_no_bias", "rms_norm", "rms_norm_2d"])
def test_norms_match_torch(make, reference, layout):
    mesh, batch = layout
    layer = make(mesh)
    x = torch.randn(5, 3, 6)
    with torch.no_grad():
        reference.weight.normal_()
    layer.load_state_dict(reference.state_dict())
    out = layer(dtorch.tensor(x, device_mesh=mesh, placements=batch))
    assert_same(out.to_torch(), reference(x).detach())


ACTIVATIONS = [("ReLU", ()), ("GELU", ()), ("GELU", ("tanh",)), ("SiLU", ()), ("Sigmoid", ()), ("Tanh", ()),
               ("LeakyReLU", (0.2,)), ("ELU", (0.5,)), ("Softplus", ()), ("Softmax", (-1,)), ("LogSoftmax", (1,)),
               ("Flatten", ()), ("Identity", ())]


@pytest.mark.parametrize("name, args", ACTIVATIONS, ids=[f"{n}{a}" for n, a in ACTIVATIONS])
def test_activations_match_torch(name, args, mesh4):
    x = torch.randn(8, 3, 4)
    out = getattr(nn, name)(*args)(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)]))
    assert_same(out.to_torch(), getattr(torch.nn, name)(*args)(x))


def test_dropout_follows_train_and_eval(mesh4, mesh1):
    layer = nn.Dropout(0.5)
    x = torch.ones(64, 8)
    layer.eval()
    assert_same(layer(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)])).to_torch(), x)
    layer.train()
    dtorch.manual_seed(9)
    sharded = layer(dtorch.tensor(x, device_mesh=mesh4, placements=[Shard(0)])).to_torch()
    dtorch.manual_seed(9)
    whole = layer(dtorch.tensor(x, device_mesh=mesh1)).to_torch()
    assert_same(sharded, whole, exact=True)
    assert set(sharded.unique().tolist()) == {0.0, 2.0}


class Block(nn.Module):
    """A small transformer-ish MLP block, and its torch twin below."""

    def __init__(self, mesh, dim=8, hidden=12):
        super().__init__()
        self.norm = nn.RMSNorm(dim, device_mesh=mesh)
        self.layers = nn.ModuleList([nn.Linear(dim, hidden, device_mesh=mesh),
                                     nn.Linear(hidden, dim, device_mesh=mesh)])
        self.act = nn.SiLU()
        self.register_buffer("scale", dtorch.full((dim,), 0.5, device_mesh=mesh))

    def forward(self, x):
        return x + self.layers[1](self.act(self.layers[0](self.norm(x)))) * self.scale


class TorchBlock(torch.nn.Module):
    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)])
        self.act = torch.nn.SiLU()
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, x):
        return x + self.layers[1](self.act(self.layers[0](self.norm(x)))) * self.scale


def test_module_tree_matches_torchs(mesh4):
    block, reference = Block(mesh4), TorchBlock()
    assert list(block.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in block.named_buffers()] == ["scale"]
    assert [n for n, _ in block.named_modules()] == [n for n, _ in reference.named_modules()]
    assert len(list(block.children())) == 3 and all(isinstance(p, nn.Parameter) for p in block.parameters())
    assert block.training and not block.eval().training and not block.layers[0].training
    assert block.train().layers[1].training
    seen = []
    block.apply(lambda m: seen.append(type(m).__name__))
    assert seen[-1] == "Block" and "Linear" in seen
    assert "RMSNorm((8,)" in repr(block) and block.device_mesh == mesh4
    x = torch.randn(6, 8)
    out, expected = run_both(block, reference, x, mesh4, [Shard(0)])
    assert_same(out.to_torch(), expected)


@pytest.mark.parametrize("plan_on", ["mesh", "submesh"])
def test_parallelize_module_with_patterns_matches_torch(plan_on, mesh22):
    model = nn.Sequential(Block(mesh22), Block(mesh22))
    reference = torch_copy(model, torch.nn.Sequential(TorchBlock(), TorchBlock()))
    plan = {"*.layers.0": nn.ColwiseParallel(), "*.layers.1": nn.RowwiseParallel(), "*.norm": nn.SequenceParallel()}
    target = mesh22 if plan_on == "mesh" else mesh22["tp"]
    nn.parallelize_module(model, target, plan)
    tp = 1
    assert model[0].layers[0].weight.placements[tp] == Shard(0)
    assert model[1].layers[1].weight.placements[tp] == Shard(1)
    x = torch.randn(4, 6, 8)
    out = model(dtorch.tensor(x, device_mesh=mesh22, placements=[Shard(0), Replicate()]))
    assert_same(out.to_torch(), reference(x).detach())


def test_parallelize_module_refuses_an_unmatched_key_and_a_wrong_module(tp2):
    model = nn.Sequential(nn.Linear(4, 4, device_mesh=tp2), nn.ReLU())
    with pytest.raises(ValueError, match="'2' matches no submodule"):
        nn.parallelize_module(model, tp2, {"2": nn.ColwiseParallel()})
    with pytest.raises(TypeError, match="ColwiseParallel applies to Embedding or Linear modules"):
        nn.parallelize_module(model, tp2, {"1": nn.ColwiseParallel()})


def test_prepare_module_input_and_output(mesh22):
    layer = nn.Linear(4, 4, device_mesh=mesh22)
    nn.parallelize_module(layer, mesh22, nn.PrepareModuleInput(desired_input_layouts=[Shard(0)]), tp_dim="tp")
    nn.parallelize_module(layer, mesh22, nn.PrepareModuleOutput(desired_output_layouts=Replicate()), tp_dim="tp")
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append(args[0].placements))
    out = layer(dtorch.randn(6, 4, device_mesh=mesh22))
    assert seen == [(Replicate(), Shard(0))] and out.placements == (Replicate(), Replicate())


def test_load_state_dict_checks_everything_before_sending_anything(tp2):
    layer = nn.ColumnParallelLinear(4, 6, device_mesh=tp2)
    before = layer.weight.to_torch()
    good = torch.nn.Linear(4, 6).state_dict()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: 'bias'.*Nothing was loaded"):
        layer.load_state_dict({"weight": good["weight"]})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: 'extra'"):
        layer.load_state_dict({**good, "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"'weight': the checkpoint has shape \(6, 5\), the model \(6, 4\)"):
        layer.load_state_dict({**good, "weight": torch.zeros(6, 5)})
    with pytest.raises(RuntimeError, match="'bias': expected a tensor, got str"):
        layer.load_state_dict({**good, "bias": "nope"})
    assert_same(layer.weight.to_torch(), before, exact=True)   # nothing half-loaded
    keys = layer.load_state_dict({"weight": good["weight"], "extra": torch.zeros(1)}, strict=False)
    assert keys == nn.IncompatibleKeys(["bias"], ["extra"])
    assert_same(layer.weight.to_torch(), good["weight"], exact=True)
    assert layer.weight.placements == (Shard(0),)


def test_load_state_dict_casts_and_takes_dtensors(tp2, mesh1):
    layer = nn.RowParallelLinear(4, 6, device_mesh=tp2, dtype=torch.bfloat16)
    source = torch.nn.Linear(4, 6).state_dict()
    layer.load_state_dict(source)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.placements == (Shard(1),)
    assert_same(layer.weight.to_torch(), source["weight"].to(torch.bfloat16), exact=True)
    other = nn.Linear(4, 6, device_mesh=mesh1)
    other.load_state_dict(layer.state_dict())      # DTensors: cast and moved to the target's mesh
    assert other.weight.device_mesh == mesh1 and other.weight.dtype == torch.float32
    assert_same(other.weight.to_torch(), source["weight"].to(torch.bfloat16).float(), exact=True)
    holder = nn.Module()
    holder.register_buffer("steps", dtorch.zeros(3, dtype=torch.int64, device_mesh=mesh1))
    with pytest.raises(RuntimeError, match="'steps': cannot cast torch.float32 to the model's torch.int64"):
        holder.load_state_dict({"steps": torch.zeros(3)})


def test_registration_refuses_local_torch_tensors_and_modules(mesh1):
    module = nn.Module()
    with pytest.raises(TypeError, match="cannot assign torch.nn.parameter.Parameter as attribute 'w'.*upload it"):
        module.w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="use the dtorch.nn layer of the same name"):
        module.lin = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="dtorch.nn.Parameter or None expected"):
        module.register_parameter("p", dtorch.zeros(2, device_mesh=mesh1))
    with pytest.raises(TypeError, match="takes a DTensor"):
        nn.Parameter(torch.zeros(2))
    module.act = torch.nn.ReLU()            # no tensors: works on DTensors through torch's functional
    module.p = nn.Parameter(dtorch.zeros(2, device_mesh=mesh1))
    module.p = None
    assert dict(module.named_parameters()) == {} and "p" in module._parameters


def test_a_parameter_shares_values_and_frees_only_its_own_id(mesh1):
    x = dtorch.arange(4.0, device_mesh=mesh1)
    p = nn.Parameter(x)
    del x
    assert p.requires_grad and p.placements == (Replicate(),)
    assert_same((p * 2).to_torch(), torch.arange(4.0) * 2)
    assert repr(p).startswith("Parameter containing:\nDTensor(shape=(4,)")


def test_conversions_rebind_parameters(tp2, mesh1):
    model = nn.Sequential(nn.ColumnParallelLinear(4, 6, device_mesh=tp2), nn.GELU())
    weight = model[0].weight.to_torch()
    model.to(torch.float64)
    assert model[0].weight.dtype == torch.float64 and isinstance(model[0].weight, nn.Parameter)
    model.bfloat16().float()
    assert model[0].weight.dtype == torch.float32 and model[0].weight.placements == (Shard(0),)
    model.to(mesh1)
    assert model.device_mesh == mesh1 and model[0].weight.placements == (Shard(0),)
    assert_same(model[0].weight.to_torch(), weight.to(torch.bfloat16).float(), exact=True)
    assert model.to("cpu") is model and model.cpu() is model   # its mesh's own device: nothing to do
    with pytest.raises(UnsupportedOpError, match=r"module.to\('cuda'\) at .*test_nn.py.*cuda_mesh"):
        model.to("cuda")
    with pytest.raises(UnsupportedOpError, match=r"module.cuda\(\) at .*test_nn.py"):
        model.cuda()


def test_containers_and_redistribute_hooks(tp2):
    layers = nn.ModuleDict({"up": nn.ColumnParallelLinearWithReplicateInputOutput(4, 6, device_mesh=tp2)})
    x = dtorch.randn(3, 4, device_mesh=tp2, placements=[Shard(0)])
    out = layers["up"](x)                      # the hook gathered the input, then the output
    assert out.placements == (Replicate(),)
    seq = nn.Sequential(nn.Linear(4, 4, device_mesh=tp2), nn.ReLU())
    assert isinstance(seq[0:1], nn.Sequential) and len(seq) == 2


@pytest.mark.parametrize("style, weight", [(nn.ColwiseParallel, Shard(1)), (nn.RowwiseParallel, Shard(0))])
def test_parallel_styles_on_an_embedding(style, weight, tp2):
    layer = nn.Embedding(10, 6, device_mesh=tp2, tp_dim=None)
    reference = torch_copy(layer, torch.nn.Embedding(10, 6))
    nn.parallelize_module(layer, tp2, style())
    assert layer.weight.placements == (weight,)
    ids = torch.tensor([[1, 9, 4], [0, 0, 7]])
    out = layer(dtorch.tensor(ids, device_mesh=tp2))
    assert_same(out.to_torch(), reference(ids).detach())


_LOSS_MODULES = [(torch.nn.MSELoss(), "real"), (torch.nn.L1Loss(), "real"), (torch.nn.SmoothL1Loss(beta=0.5), "real"),
                 (torch.nn.HuberLoss(delta=0.7), "real"), (torch.nn.BCELoss(), "probability"),
                 (torch.nn.BCEWithLogitsLoss(pos_weight=None), "probability"),
                 (torch.nn.KLDivLoss(reduction="batchmean"), "log"), (torch.nn.NLLLoss(reduction="sum"), "class"),
                 (torch.nn.CrossEntropyLoss(), "class")]


@pytest.mark.parametrize("module, kind", _LOSS_MODULES, ids=lambda v: type(v).__name__ if not isinstance(v, str) else v)
def test_torch_loss_modules_on_a_batch_sharded_input_equal_torch(module, kind, mesh4, automatic):
    """torch.nn's loss modules reach dtorch's losses through __torch_function__; on a batch split
    over 4 ranks (uneven: 10 rows) each rank sums its rows and divides by the global count, so
    the loss and its gradient equal torch's."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 6, generator=g)
    if kind == "class":
        value, target = torch.log_softmax(logits, 1), torch.randint(0, 6, (10,), generator=g)
        value = logits if isinstance(module, torch.nn.CrossEntropyLoss) else value
    elif kind == "log":
        value, target = torch.log_softmax(logits, 1), torch.softmax(torch.randn(10, 6, generator=g), 1)
    elif kind == "probability":
        value = logits if isinstance(module, torch.nn.BCEWithLogitsLoss) else torch.sigmoid(logits)
        target = torch.rand(10, 6, generator=g)
    else:
        value, target = logits, torch.randn(10, 6, generator=g)
    reference = value.clone().requires_grad_()
    expected = module(reference, target)
    expected.backward()
    x = dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)], requires_grad=True)
    loss = module(x, dtorch.tensor(target, device_mesh=mesh4, placements=[Shard(0)]))
    loss.backward()
    torch.testing.assert_close(loss.to_torch(), expected.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x.grad.to_torch(), reference.grad, rtol=1e-4, atol=1e-6)


_CLASS_LOSS_KWARGS = [{}, {"weight": True}, {"label_smoothing": 0.1}, {"weight": True, "label_smoothing": 0.2},
                      {"ignore_index": 1}]


@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("shape", [(10, 6), (9, 5, 3)], ids=["rows", "rows-and-positions"])
def test_a_class_loss_mean_over_a_sharded_batch_moves_no_input(name, shape, mesh4, mesh22):
    """cross_entropy / nll_loss with reduction='mean' on a batch sharded over dp: the sum stays
    sharded and the count of targets that are not ignore_index (weighted by class) is summed
    beside it, so no input is gathered (no inserted redistribute), in strict mode too; values
    and gradients equal torch's (uneven shapes, ignored targets, class weights, smoothing)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(*shape, generator=g)
    value = logits if name == "cross_entropy" else torch.log_softmax(logits, 1)
    targets = torch.randint(0, shape[1], (shape[0],) + shape[2:], generator=g)
    targets.view(-1)[[2, 5]] = -100
    weight = torch.rand(shape[1], generator=g) + 0.5
    for kwargs in _CLASS_LOSS_KWARGS:
        if name == "nll_loss" and "label_smoothing" in kwargs:
            continue
        target = targets.clone()
        target[target == -100] = kwargs.get("ignore_index", -100)
        given = dict(kwargs, weight=weight) if "weight" in kwargs else kwargs
        reference = value.clone().requires_grad_()
        expected = getattr(F, name)(reference, target, **given)
        expected.backward()
        for mesh in (mesh4, mesh22):
            batch = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
            x = dtorch.tensor(value, device_mesh=mesh, placements=batch, requires_grad=True)
            placed = (dict(kwargs, weight=dtorch.tensor(weight, device_mesh=mesh, placements=[Replicate()] * mesh.ndim))
                      if "weight" in kwargs else kwargs)
            before, strict = dtorch.stats()["redistributes_inserted"], dtorch.is_strict()
            dtorch.set_strict(True)
            try:
                loss = getattr(F, name)(x, dtorch.tensor(target, device_mesh=mesh, placements=batch), **placed)
            finally:
                dtorch.set_strict(strict)
            assert dtorch.stats()["redistributes_inserted"] == before, kwargs
            loss.backward()
            torch.testing.assert_close(loss.to_torch(), expected.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(x.grad.to_torch(), reference.grad, rtol=1e-4, atol=1e-6)



_CLASS_SHARDED = [((4,), [Shard(1)]), ((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Shard(1), Shard(0)]),
                  ((2, 2), [Replicate(), Shard(1)])]


@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("shape", [(10, 7), (9, 5, 3)], ids=["rows", "rows-and-positions"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_class_loss_over_sharded_classes_never_gathers_them(name, shape, reduction, mesh4, mesh22):
    """A vocabulary-parallel head: F.cross_entropy / nll_loss of logits whose class dim is sharded
    (uneven: 7 and 5 classes over 2 or 4 ranks), batch sharded or not, build the loss from the
    shards (max, sum of exponentials and the target's logit, each reduced over the class dim), so
    no input is moved (strict mode passes); values and gradients equal torch's with ignored
    targets, another ignore_index and label smoothing."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(*shape, generator=g)
    targets = torch.randint(0, shape[1], (shape[0],) + shape[2:], generator=g)
    targets.view(-1)[[1, 4]] = -100
    meshes = {(4,): mesh4, (2, 2): mesh22}
    for kwargs in ({}, {"label_smoothing": 0.2}, {"ignore_index": 2}):
        if name == "nll_loss" and "label_smoothing" in kwargs:
            continue
        target = targets.clone()
        target[target == -100] = kwargs.get("ignore_index", -100)
        reference = logits.clone().requires_grad_()
        value = reference if name == "cross_entropy" else torch.log_softmax(reference, 1)
        expected = getattr(F, name)(value, target, reduction=reduction, **kwargs)
        expected.sum().backward()
        for mesh_shape, placements in _CLASS_SHARDED:
            mesh = meshes[mesh_shape]
            x = dtorch.tensor(logits, device_mesh=mesh, placements=placements, requires_grad=True)
            given = x if name == "cross_entropy" else x - x.detach().exp().sum(1, keepdim=True).log()
            labels = dtorch.tensor(target, device_mesh=mesh,
                                   placements=[p if p.is_shard(0) else Replicate() for p in placements])
            before, strict = dtorch.stats()["redistributes_inserted"], dtorch.is_strict()
            dtorch.set_strict(True)
            try:
                loss = getattr(F, name)(given, labels, reduction=reduction, **kwargs)
            finally:
                dtorch.set_strict(strict)
            assert dtorch.stats()["redistributes_inserted"] == before, (placements, kwargs)
            loss.sum().backward()
            where = f"{placements} {kwargs}"
            torch.testing.assert_close(loss.to_torch(), expected.detach(), rtol=1e-5, atol=1e-5, msg=where)
            if name == "cross_entropy":   # (nll_loss's input above is not torch's log_softmax graph)
                torch.testing.assert_close(x.grad.to_torch(), reference.grad, rtol=1e-4, atol=1e-6, msg=where)

_INITS = {"normal_": lambda t: torch.nn.init.normal_(t, 0.5, 2.0),
          "uniform_": lambda t: torch.nn.init.uniform_(t, -3, 1),
          "xavier_uniform_": torch.nn.init.xavier_uniform_, "xavier_normal_": torch.nn.init.xavier_normal_,
          "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5 ** 0.5),
          "kaiming_normal_": torch.nn.init.kaiming_normal_, "constant_": lambda t: torch.nn.init.constant_(t, 0.3),
          "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.5, a=-0.4, b=0.9),
          "trunc_normal_ (narrow)": lambda t: torch.nn.init.trunc_normal_(t, a=2.0, b=3.0)}


# exact bounds: fan_in 96, fan_out 256; kaiming_uniform_ with a = sqrt(5) has gain sqrt(1 / 3)
_BOUNDS = {"uniform_": (-3, 1), "constant_": (0.3, 0.3), "trunc_normal_": (-0.4, 0.9),
           "trunc_normal_ (narrow)": (2.0, 3.0), "xavier_uniform_": (-(6 / 352) ** 0.5, (6 / 352) ** 0.5),
           "kaiming_uniform_": (-(1 / 96) ** 0.5, (1 / 96) ** 0.5)}


@pytest.mark.parametrize("name", list(_INITS))
def test_torch_nn_init_refills_a_parameter_the_same_on_every_layout(name, mesh4, mesh22):
    """torch.nn.init's own code runs on a DTensor parameter (under torch.no_grad, in place): the
    values come from dtorch's stream, the same for one seed on every layout, and have the
    distribution torch's would (bounds exact, moments loose); the parameter stays a leaf."""
    init = _INITS[name]
    values = []
    for mesh, placements in ((mesh4, [Shard(0)]), (mesh4, [Replicate()]), (mesh22, [Shard(1), Shard(0)])):
        dtorch.manual_seed(11)
        parameter = nn.Parameter(dtorch.zeros(256, 96, device_mesh=mesh, placements=placements))
        assert init(parameter) is parameter
        assert parameter.is_leaf and parameter.requires_grad and parameter.placements == placements
        values.append(parameter.to_torch())
    assert all(torch.equal(values[0], v) for v in values[1:])
    reference = torch.zeros(256, 96)
    init(reference)
    got = values[0]
    if name in _BOUNDS:
        low, high = _BOUNDS[name]
        assert low - 1e-5 <= got.min() and got.max() <= high + 1e-5
    torch.testing.assert_close(got.mean(), reference.mean(), atol=0.05 * max(1.0, reference.std().item()), rtol=0)
    torch.testing.assert_close(got.std(), reference.std(), rtol=0.05, atol=1e-6)


def test_torch_spellings_of_like_factories_and_new_tensor(mesh4):
    x = dtorch.randn(6, 4, device_mesh=mesh4, placements=[Shard(0)])
    for made, value in ((torch.zeros_like(x), 0.0), (torch.ones_like(x, dtype=torch.float64), 1.0),
                        (torch.full_like(x, 2.5), 2.5)):
        assert made.placements == x.placements and made.shape == x.shape
        assert torch.equal(made.to_torch(), torch.full((6, 4), value, dtype=made.dtype))
    assert torch.ones_like(x, dtype=torch.float64).dtype == torch.float64
    assert torch.empty_like(x).shape == x.shape and torch.randn_like(x).placements == x.placements
    local = x.new_tensor(0.1, device="cpu")
    assert isinstance(local, torch.Tensor) and local.dtype == torch.float32
    placed = x.new_tensor([1.0, 2.0])
    assert placed.placements == (Replicate(),) and torch.equal(placed.to_torch(), torch.tensor([1.0, 2.0]))
    with pytest.raises(dtorch.DTorchError, match="mesh"):
        torch.zeros_like(x, device="cuda")
    for shape in ((4, 4), (6, 3), (3, 6)):   # torch's own code: normal_, t_, linalg.qr, diag, copy_
        weight = nn.Parameter(dtorch.zeros(*shape, device_mesh=mesh4, placements=[Shard(0)]))
        torch.nn.init.orthogonal_(weight, gain=2.0)
        w = weight.to_torch()
        gram = w @ w.T if shape[0] <= shape[1] else w.T @ w
        assert weight.placements == (Shard(0),) and torch.allclose(gram, 4 * torch.eye(min(shape)), atol=1e-5)
    identity = nn.Parameter(dtorch.zeros(4, 6, device_mesh=mesh4, placements=[Shard(1)]))
    torch.nn.init.eye_(identity)   # torch.eye(4, 6, out=identity)
    assert identity.placements == (Shard(1),) and torch.equal(identity.to_torch(), torch.eye(4, 6))


def test_a_loop_written_the_torch_way_trains_as_torch_does(mesh4):
    """What a torch user writes, on a batch sharded over dp: torch.nn.init through model.apply,
    torch.nn.CrossEntropyLoss with label smoothing, clipping, AdamW with torch's LR scheduler,
    an evaluation under torch.no_grad() and f-string logging. Losses, accuracy and parameters
    equal single-process torch's."""
    import torch.nn as tnn
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(64, 20, generator=g), torch.randint(0, 5, (64,), generator=g)

    def init(module):
        if isinstance(module, (tnn.Linear, nn.Linear)):
            tnn.init.xavier_uniform_(module.weight)
            tnn.init.zeros_(module.bias)
    model = nn.Sequential(nn.Linear(20, 32, device_mesh=mesh4), nn.ReLU(), nn.Linear(32, 5, device_mesh=mesh4))
    model.apply(init)
    reference = tnn.Sequential(tnn.Linear(20, 32), tnn.ReLU(), tnn.Linear(32, 5))
    reference.load_state_dict({k: v.to_torch() for k, v in model.state_dict().items()})
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (optimizer, reference_optimizer)]
    loss_of = tnn.CrossEntropyLoss(label_smoothing=0.1)

    def placed(value):
        return dtorch.tensor(value, device_mesh=mesh4, placements=[Shard(0)])
    for _ in range(3):
        for rows in (slice(0, 32), slice(32, 64)):
            loss = loss_of(model(placed(inputs[rows])), placed(labels[rows]))
            loss.backward()
            expected = loss_of(reference(inputs[rows]), labels[rows])
            expected.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            tnn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            for o in (optimizer, reference_optimizer):
                o.step()
                o.zero_grad()
            assert abs(float(f"{loss:.6f}") - expected.item()) < 1e-4   # (the f-string reads it)
        for schedule in schedules:
            schedule.step()
        with torch.no_grad():
            logits = model(placed(inputs))
            accuracy = (logits.argmax(1) == placed(labels)).float().mean()
        assert not logits.requires_grad
        assert accuracy.item() == (reference(inputs).argmax(1) == labels).float().mean().item()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.to_torch(), theirs.detach(), rtol=1e-4, atol=1e-5)


_ATTENTION_DROPOUT = {"plain": {}, "causal": {"is_causal": True}, "bool mask": {"mask": "bool"},
                      "float mask, scale": {"mask": "float", "scale": 0.3}, "grouped heads": {"enable_gqa": True}}


@pytest.mark.parametrize("case", list(_ATTENTION_DROPOUT))
def test_attention_with_dropout_drops_from_dtorchs_stream(case, mesh4, mesh22):
    """F.scaled_dot_product_attention(dropout_p > 0) (nanoGPT's training call) is torch's math
    form with dtorch's dropout: it equals softmax(q k^T * scale + mask) times the mask
    F.dropout draws for the same seed and call, times v, on two layouts (batch and heads
    sharded), and so do the gradients of q, k and v. The op itself refuses dropout_p."""
    import torch.nn.functional as F
    kwargs = dict(_ATTENTION_DROPOUT[case])
    g = torch.Generator().manual_seed(9)
    heads, kv_heads = 4, (2 if kwargs.get("enable_gqa") else 4)
    q = torch.randn(2, heads, 5, 6, generator=g)
    keys = 7 if "mask" in kwargs else 5   # (a causal mask is square)
    k, v = torch.randn(2, kv_heads, keys, 6, generator=g), torch.randn(2, kv_heads, keys, 6, generator=g)
    mask = kwargs.pop("mask", None)
    if mask is not None:
        mask = torch.rand(5, keys, generator=g) > 0.3 if mask == "bool" else torch.randn(5, keys, generator=g)
        if mask.dtype == torch.bool:
            mask[:, 0] = True   # every query sees a key
        kwargs["attn_mask"] = mask
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    for mesh, placements in ((mesh4, [Shard(0)]), (mesh22, [Shard(0), Shard(1)])):
        inputs = [dtorch.tensor(t, device_mesh=mesh, placements=placements, requires_grad=True) for t in (q, k, v)]
        dtorch.manual_seed(21)
        out = F.scaled_dot_product_attention(*inputs, dropout_p=0.4, **kwargs)
        dtorch.manual_seed(21)
        kept = dtorch.nn.functional.dropout(dtorch.ones(2, heads, 5, keys, device_mesh=mesh,
                                                        placements=placements), 0.4).to_torch()
        rq, rk, rv = references
        if kwargs.get("enable_gqa"):
            rk, rv = rk.repeat_interleave(2, -3), rv.repeat_interleave(2, -3)
        scores = rq @ rk.transpose(-2, -1) * kwargs.get("scale", 1 / 6 ** 0.5)
        if kwargs.get("is_causal"):
            scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        expected = (torch.softmax(scores, -1) * kept) @ rv
        assert 0 < (kept == 0).float().mean() < 1
        torch.testing.assert_close(out.to_torch(), expected.detach(), rtol=1e-5, atol=1e-6)
        (out * out).sum().backward()
        for reference in references:
            reference.grad = None
        (expected * expected).sum().backward()
        for got, reference in zip(inputs, references):
            torch.testing.assert_close(got.grad.to_torch(), reference.grad, rtol=1e-4, atol=1e-5)
    if case == "plain":
        with pytest.raises(dtorch.UnsupportedOpError, match="torch.nn.functional.scaled_dot_product_attention"):
            dtorch.scaled_dot_product_attention(inputs[0], inputs[1], inputs[2], None, 0.4)


def test_mixed_precision_casts_a_float32_input_to_the_compute_dtype(mesh4):
    """As FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True): a float32 batch met bfloat16
    weights in torch's kernels, which refuse two dtypes (the workers failed at the read). The
    output, the gradients' dtype (float32 masters) and values against torch's bf16 model."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model = dtorch.nn.mixed_precision(dtorch.distribute_module(copy.deepcopy(reference), mesh4), torch.bfloat16)
    x = torch.randn(5, 6)
    out = model(dtorch.distribute_tensor(x, mesh4, [Shard(0)]))
    assert out.dtype == torch.bfloat16
    expected = copy.deepcopy(reference).to(torch.bfloat16)(x.to(torch.bfloat16))
    torch.testing.assert_close(out.to_torch(), expected)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
