"""torch's tensor-parallel vocabulary on dtorch (issue 42, items 5 and 6): torch's own style
objects and placements in dtorch's parallelize_module, torch's loss_parallel, the parts of
torch's DeviceMesh API that mean something with a single controller (and clear refusals, naming
dtorch's call, for the rest), and Colwise/Rowwise on transformers' Conv1D (GPT-2), each against
single-process torch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F
from torch.distributed import tensor as torch_tensor
from torch.distributed.tensor import parallel as tp

import dtorch
from dtorch import MeshError, PlacementError, Replicate, Shard, nn
from dtorch.spec.placements import DeviceMesh, init_device_mesh
from dtorch.nn.parallel import from_torch_style, loss_parallel

from support import assert_same

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tp2(session):
    return init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])


# --- torch's styles read into dtorch's (pure) ---------------------------------------------------
@pytest.mark.parametrize("torch_style, expected_class, attributes", [
    (tp.ColwiseParallel(), nn.ColwiseParallel, {"output_layouts": Shard(-1)}),
    (tp.ColwiseParallel(input_layouts=torch_tensor.Shard(1), output_layouts=torch_tensor.Replicate()),
     nn.ColwiseParallel, {"input_layouts": Shard(1), "output_layouts": Replicate()}),
    (tp.RowwiseParallel(output_layouts=torch_tensor.Shard(1)), nn.RowwiseParallel, {"output_layouts": Shard(1)}),
    (tp.SequenceParallel(sequence_dim=0), nn.SequenceParallel, {"sequence_dim": 0}),
    (tp.PrepareModuleInput(input_layouts=(torch_tensor.Shard(1), None),
                           desired_input_layouts=(torch_tensor.Replicate(), None)),
     nn.PrepareModuleInput, {"desired": [Replicate(), None]}),
    (tp.PrepareModuleInput(input_kwarg_layouts={"h": torch_tensor.Shard(1)},
                           desired_input_kwarg_layouts={"h": torch_tensor.Replicate()}),
     nn.PrepareModuleInput, {"desired_kwargs": {"h": Replicate()}}),
    (tp.PrepareModuleOutput(output_layouts=torch_tensor.Replicate(), desired_output_layouts=torch_tensor.Shard(0)),
     nn.PrepareModuleOutput, {"desired": [Shard(0)]}),
])
def test_a_torch_style_becomes_dtorch_style_of_the_same_name(torch_style, expected_class, attributes):
    style = from_torch_style(torch_style)
    assert type(style) is expected_class
    for name, value in attributes.items():
        assert getattr(style, name) == value, name


def test_prepare_module_input_output_and_torch_placements_in_dtorch_styles():
    both = from_torch_style(tp.PrepareModuleInputOutput(
        input_layouts=torch_tensor.Shard(0), desired_input_layouts=torch_tensor.Replicate(),
        output_layouts=torch_tensor.Replicate(), desired_output_layouts=torch_tensor.Shard(1)))
    assert both.prepare_module_input.desired == [Replicate()]
    assert both.prepare_module_output.desired == [Shard(1)]
    assert nn.RowwiseParallel(output_layouts=torch_tensor.Shard(1)).output_layouts == Shard(1)
    assert nn.PrepareModuleOutput(desired_output_layouts=torch_tensor.Partial()).desired[0] == dtorch.Partial("sum")


def test_a_style_dtorch_cannot_run_is_refused_by_name():
    class OwnApply(tp.ColwiseParallel):
        def _apply(self, module, device_mesh):
            return module

    class Defaults(tp.ColwiseParallel):   # only its constructor differs: read like torch's own
        def __init__(self):
            super().__init__(output_layouts=torch_tensor.Replicate())

    assert from_torch_style(Defaults()).output_layouts == Replicate()
    with pytest.raises(TypeError, match="OwnApply is not a style dtorch can run.*dtorch.nn.ParallelStyle"):
        from_torch_style(OwnApply())
    with pytest.raises(TypeError, match="str is not a style"):
        nn.parallelize_module(tnn.Linear(2, 2), DeviceMesh("cpu", [0, 1], ["tp"]), {"": "colwise"})
    strided = torch_tensor.placement_types._StridedShard(0, split_factor=2)
    with pytest.raises(PlacementError, match="Shard\\(d\\), Replicate\\(\\) or Partial\\(\\)"):
        nn.ColwiseParallel(output_layouts=strided)


# --- torch's DeviceMesh API (pure) ----------------------------------------------------------------
def test_device_mesh_answers_torch_questions_as_its_first_rank():
    mesh = DeviceMesh("cpu", [[4, 5], [6, 7]], ["dp", "tp"])
    assert torch.equal(mesh.mesh, torch.tensor([[4, 5], [6, 7]], dtype=torch.int))
    assert (mesh.ndim, mesh.shape, mesh.size(), mesh.size(1), mesh.device_type) == (2, (2, 2), 4, 2, "cpu")
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert (mesh.get_rank(), mesh.get_local_rank("tp"), mesh.get_local_rank(0)) == (4, 0, 0)
    assert mesh["tp"].get_local_rank() == 0 and mesh["tp"].ranks == (4, 5)
    assert mesh["dp", "tp"] == mesh and mesh[("dp",)].ranks == (4, 6)
    with pytest.raises(MeshError, match="name the mesh dim"):
        mesh.get_local_rank()
    with pytest.raises(MeshError, match="in the mesh's order"):
        mesh["tp", "dp"]


@pytest.mark.parametrize("call", ["get_coordinate", "get_group", "get_all_groups"])
def test_per_rank_questions_are_refused_naming_dtorchs_call(call):
    mesh = DeviceMesh("cpu", [0, 1], ["tp"])
    with pytest.raises(MeshError, match=f"{call}.*single controller.*dtorch.nn.parallelize_module"):
        getattr(mesh, call)()


@pytest.mark.parametrize("torch_call", [
    lambda model, mesh: tp.parallelize_module(model, mesh, {"0": tp.ColwiseParallel()}),
    lambda model, mesh: torch_tensor.distribute_module(model, mesh),
    lambda model, mesh: torch_tensor.distribute_tensor(model[0].weight.detach(), mesh, [torch_tensor.Shard(0)]),
], ids=["parallelize_module", "distribute_module", "distribute_tensor"])
def test_torchs_per_rank_functions_on_a_dtorch_mesh_say_what_to_write(torch_call):
    """They build the calling rank's own shard, and this process is no rank: the first question
    that needs one (get_coordinate) raises, naming dtorch's function that takes the same plan."""
    mesh = DeviceMesh("cpu", [0, 1], ["tp"])
    with pytest.raises(MeshError, match="dtorch.nn.parallelize_module\\(model, mesh, plan\\)"):
        torch_call(tnn.Sequential(tnn.Linear(4, 4)), mesh)


# --- a torchtitan-style plan in torch's own styles --------------------------------------------------
class Attention(tnn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (tnn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(tnn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = tnn.Linear(dim, 2 * dim), tnn.Linear(2 * dim, dim), tnn.Linear(dim, 2 * dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Transformer(tnn.Module):
    def __init__(self, vocab: int = 24, dim: int = 16, heads: int = 4):
        super().__init__()
        self.embed = tnn.Embedding(vocab, dim)
        self.attention_norm, self.attention = tnn.LayerNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = tnn.RMSNorm(dim), FeedForward(dim)
        self.norm, self.output = tnn.LayerNorm(dim), tnn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attention(self.attention_norm(h))
        h = h + self.feed_forward(self.ffn_norm(h))
        return self.output(self.norm(h))


def torchtitan_plan() -> dict:
    """torchtitan's Llama plan, sequence parallel and loss parallel included, in torch's styles."""
    return {
        "embed": tp.RowwiseParallel(input_layouts=torch_tensor.Replicate(), output_layouts=torch_tensor.Shard(1)),
        "norm": tp.SequenceParallel(),
        "output": tp.ColwiseParallel(input_layouts=torch_tensor.Shard(1), output_layouts=torch_tensor.Shard(-1),
                                     use_local_output=False),
        "attention_norm": tp.SequenceParallel(),
        "attention": tp.PrepareModuleInput(input_layouts=(torch_tensor.Shard(1),),
                                           desired_input_layouts=(torch_tensor.Replicate(),)),
        "attention.w[qkv]": tp.ColwiseParallel(),
        "attention.wo": tp.RowwiseParallel(output_layouts=torch_tensor.Shard(1)),
        "ffn_norm": tp.SequenceParallel(),
        "feed_forward": tp.PrepareModuleInput(input_layouts=(torch_tensor.Shard(1),),
                                              desired_input_layouts=(torch_tensor.Replicate(),)),
        "feed_forward.w[13]": tp.ColwiseParallel(),
        "feed_forward.w2": tp.RowwiseParallel(output_layouts=torch_tensor.Shard(1)),
    }


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
@pytest.mark.parametrize("loss_context", [tp.loss_parallel, loss_parallel], ids=["torch", "dtorch"])
def test_torchtitan_plan_in_torchs_styles_trains_as_torch(layout, loss_context, request):
    """torch's styles and placements, as torchtitan writes them, on a torch model: the loss under
    loss_parallel (logits sharded on the vocabulary) and every gradient equal torch's."""
    torch.manual_seed(3)
    reference = Transformer()
    model = copy.deepcopy(reference)
    mesh = request.getfixturevalue("tp2" if layout == "tp2" else "mesh22")
    batch = [Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names]
    nn.parallelize_module(model, mesh, torchtitan_plan(), tp_dim="tp")
    tp_dim = mesh.mesh_dim_names.index("tp")
    assert model.attention.wq.weight.placements[tp_dim] == Shard(0)
    assert model.feed_forward.w2.weight.placements[tp_dim] == Shard(1)
    assert model.embed.weight.placements[tp_dim] == Shard(0)
    tokens, labels = torch.randint(0, 24, (2, 6)), torch.randint(0, 24, (2, 6))
    logits = model(dtorch.distribute_tensor(tokens, mesh, batch))
    assert logits.placements[tp_dim] == Shard(2)
    with loss_context():
        loss = F.cross_entropy(logits.flatten(0, 1), dtorch.distribute_tensor(labels, mesh, batch).flatten(0, 1))
        loss.backward()
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten(0, 1))
    expected.backward()
    assert_same(loss.to_torch(), expected.detach())
    parameters = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert_same(parameters[name].grad.to_torch(), parameter.grad)


# --- transformers' Conv1D (GPT-2's projections) ---------------------------------------------------
@pytest.mark.parametrize("style", [nn.ColwiseParallel, nn.RowwiseParallel])
@pytest.mark.parametrize("batch_shape", [(3,), (2, 3)])
def test_conv1d_colwise_and_rowwise_match_torch(style, batch_shape, tp2):
    """Conv1D is y = x @ W + b with W (in, out): Colwise shards W on dim 1 and b, Rowwise W on dim 0
    (b replicated). An uneven split (5 outputs or inputs over 2 ranks) included."""
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(5)
    reference = Conv1D(nf=5, nx=5)
    torch.nn.init.normal_(reference.bias)
    layer = copy.deepcopy(reference)
    nn.parallelize_module(layer, tp2, style())
    expected_weight = Shard(1) if style is nn.ColwiseParallel else Shard(0)
    assert layer.weight.placements == (expected_weight,)
    assert layer.bias.placements == ((Shard(0),) if style is nn.ColwiseParallel else (Replicate(),))
    x = torch.randn(*batch_shape, 5)
    out = layer(dtorch.distribute_tensor(x, tp2, [Replicate()]))
    expected = reference(x)
    assert_same(out.to_torch(), expected.detach())
    out.sum().backward()
    expected.sum().backward()
    assert_same(layer.weight.grad.to_torch(), reference.weight.grad)
    assert_same(layer.bias.grad.to_torch(), reference.bias.grad)


def test_a_module_that_only_looks_like_conv1d_is_refused(tp2):
    class Conv1D(tnn.Module):     # named so, but its weight is not (in, nf)
        def __init__(self):
            super().__init__()
            self.nf, self.weight = 3, tnn.Parameter(torch.zeros(3, 4))

    with pytest.raises(TypeError, match="ColwiseParallel applies to Embedding or Linear modules .* or "
                                        "transformers' Conv1D, not DistributedConv1D"):
        nn.parallelize_module(Conv1D(), tp2, nn.ColwiseParallel())
    with pytest.raises(TypeError, match="RowwiseParallel applies to .* not DistributedConv1d"):
        nn.parallelize_module(tnn.Conv1d(2, 2, 1), tp2, nn.RowwiseParallel())


def gpt2_plan(styles) -> dict:
    colwise, rowwise = styles
    return {"transformer.h.*.attn.c_attn": colwise(), "transformer.h.*.attn.c_proj": rowwise(),
            "transformer.h.*.mlp.c_fc": colwise(), "transformer.h.*.mlp.c_proj": rowwise()}


@pytest.mark.parametrize("styles", [(tp.ColwiseParallel, tp.RowwiseParallel), (nn.ColwiseParallel, nn.RowwiseParallel)],
                         ids=["torch styles", "dtorch styles"])
@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_gpt2_tensor_parallel_equals_transformers(styles, layout, request):
    """GPT-2 as its docs use it (model(input_ids, labels=...)) with its Conv1D projections
    Megatron-split: c_attn's fused q/k/v output is column-sharded, and its split into q, k and v
    gives the true heads (a DTensor is its whole self; the split moves the blocks it needs).
    Logits, loss and every gradient equal transformers' on the same weights."""
    torch.manual_seed(7)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(reference)
    mesh = request.getfixturevalue("tp2" if layout == "tp2" else "mesh22")
    nn.parallelize_module(model, mesh, gpt2_plan(styles), tp_dim="tp")
    tp_dim = mesh.mesh_dim_names.index("tp")
    assert model.transformer.h[1].attn.c_attn.weight.placements[tp_dim] == Shard(1)
    assert model.transformer.h[1].mlp.c_proj.weight.placements[tp_dim] == Shard(0)
    input_ids = torch.randint(0, 64, (2, 8))
    batch = [Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names]
    ids = dtorch.distribute_tensor(input_ids, mesh, batch)
    out = model(ids, labels=ids)
    expected = reference(input_ids, labels=input_ids)
    assert_same(out.logits.to_torch(), expected.logits.detach())
    assert_same(out.loss.to_torch(), expected.loss.detach())
    out.loss.backward()
    expected.loss.backward()
    parameters = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert_same(parameters[name].grad.to_torch(), parameter.grad)
