"""A torch model of the user's own (torch.nn layers, their own forward) on a mesh: distribute_module
and parallelize_module make it a dtorch model in place, and it trains as single-process torch does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module


class TinyLM(tnn.Module):
    """An ordinary torch model: the head tied to the embedding, a norm, an MLP, dropout, a
    buffer, and a forward written against torch.nn.functional."""

    def __init__(self, vocab: int = 23, hidden: int = 12):
        super().__init__()
        self.embed = tnn.Embedding(vocab, hidden)
        self.norm = tnn.LayerNorm(hidden)
        self.mlp = tnn.Sequential(tnn.Linear(hidden, 2 * hidden), tnn.GELU(), tnn.Linear(2 * hidden, hidden))
        self.drop = tnn.Dropout(0.0)
        self.head = tnn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.drop(self.mlp(self.norm(h))) * self.scale
        return self.head(F.layer_norm(h, h.shape[-1:]))


def _batches(steps: int, vocab: int = 23):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (6, 5), generator=g) for _ in range(steps)]


def _train(model, batches, optimizer_class, place=lambda ids: ids):
    """Each step's loss: 3 steps of next-token cross-entropy with AdamW (torch's or dtorch's);
    `place` puts each batch where the model is."""
    opt = optimizer_class(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for ids in map(place, batches):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        _step((opt, loss))
        losses.append(loss.item())
    return losses


def _step(*pairs):
    """backward, step and zero_grad for each (optimizer, loss)."""
    for optimizer, loss in pairs:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _check_parameters(model, reference):
    for (name, got), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.to_torch(), expected.detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", ["dp4", "fsdp4", "dp2xtp2"])
def test_a_torch_model_of_ones_own_trains_as_torch_does(layout, mesh4, mesh22):
    """The same random-init TinyLM trains 3 AdamW steps on a batch over dp (parameters
    Replicate), over fsdp (dtorch.nn.fully_shard on the distributed model), and on dp x tp (torch's
    parallelize_module plan on the torch model itself); every loss and the final parameters equal
    single-process torch's. The tied head stays one parameter."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    mesh = mesh22 if layout == "dp2xtp2" else mesh4
    if layout == "dp2xtp2":
        parallelize_module(model, mesh, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}, tp_dim="tp")
        assert model.mlp[0].weight.placements == (Replicate(), Shard(0))
        assert model.mlp[2].weight.placements == (Replicate(), Shard(1))
    else:
        assert dtorch.distribute_module(model, mesh) is model
        if layout == "fsdp4":
            fully_shard(model, "dp")
            assert model.mlp[0].weight.placements == (Shard(0),)
    assert isinstance(model, dtorch.nn.Module) and isinstance(model, TinyLM)
    assert isinstance(model.mlp[0], tnn.Linear) and isinstance(model.mlp[0].weight, dtorch.nn.Parameter)
    assert (model.head.weight is model.embed.weight
            and len(list(model.parameters())) == len(list(reference.parameters())))
    assert isinstance(model.scale, dtorch.DTensor) and list(model.state_dict()) == list(reference.state_dict())
    batch = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    batches = _batches(3)
    expected = _train(reference, batches, torch.optim.AdamW)
    got = _train(model, batches, dtorch.optim.AdamW, lambda ids: dtorch.distribute_tensor(ids, mesh, batch))
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=0)
    _check_parameters(model, reference)


def test_partition_fn_input_fn_and_output_fn_as_torch_spells_them(mesh4):
    """partition_fn places what it wants (here the first Linear column-parallel), the rest is
    replicated; input_fn uploads the plain torch input, output_fn reads the result back: the
    module is then called with torch tensors and returns one, equal to torch's."""
    torch.manual_seed(1)
    reference = tnn.Sequential(tnn.Linear(8, 16), tnn.ReLU(), tnn.Linear(16, 4))
    model = copy.deepcopy(reference)
    seen = []

    def partition(name, module, mesh):
        seen.append(name)
        if name == "0":
            for key, param in list(module.named_parameters()):
                setattr(module, key, dtorch.nn.Parameter(dtorch.distribute_tensor(param.detach(), mesh, [Shard(0)])))

    dtorch.distribute_module(model, mesh4, partition,
                             input_fn=lambda mod, inputs, mesh: tuple(dtorch.distribute_tensor(t, mesh, [Replicate()])
                                                                      for t in inputs),
                             output_fn=lambda mod, output, mesh: output.to_torch())
    assert seen == ["", "0", "1", "2"]
    assert model[0].weight.placements == (Shard(0),) and model[2].weight.placements == (Replicate(),)
    x = torch.randn(5, 8)
    out = model(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, reference(x).detach(), rtol=1e-5, atol=1e-6)


def test_a_torch_state_dict_loads_into_the_distributed_model(mesh22):
    torch.manual_seed(2)
    source, target = TinyLM(), TinyLM()
    dtorch.distribute_module(target, mesh22)
    target.load_state_dict(source.state_dict())
    ids = torch.randint(0, 23, (4, 5))
    got = target(dtorch.distribute_tensor(ids, mesh22, [Shard(0), Replicate()])).to_torch()
    torch.testing.assert_close(got, source(ids).detach(), rtol=1e-5, atol=1e-6)
    # and back: a plain torch model loads the distributed one's state_dict (copy_ of a DTensor
    # into a torch tensor reads it; it raised "'Parameter' object has no attribute 'device_mesh'")
    plain = TinyLM()
    plain.load_state_dict(target.state_dict())
    torch.testing.assert_close(plain(ids), source(ids), rtol=1e-5, atol=1e-6)


def test_what_distribute_module_refuses_says_what_to_do(mesh4):
    with pytest.raises(TypeError, match="needs device_mesh="):
        dtorch.distribute_module(tnn.Linear(2, 2))
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        dtorch.distribute_module(torch.zeros(2), mesh4)
    with pytest.raises(dtorch.MeshError, match="pass device_mesh="):
        parallelize_module(tnn.Sequential(tnn.Linear(2, 2)), None, {"0": ColwiseParallel()})
    x = dtorch.randn(2, 3, 8, device_mesh=mesh4, placements=[Shard(0)])
    legacy = dtorch.distribute_module(tnn.MultiheadAttention(8, 2, add_bias_kv=True), mesh4)
    with pytest.raises(dtorch.UnsupportedOpError, match="add_bias_kv=True"):
        legacy(x, x, x)
    # torch would only warn ("module output should be a Tensor") and never call the hook
    linear = dtorch.distribute_module(tnn.Linear(2, 2), mesh4)
    for register in (linear.register_full_backward_hook, linear.register_full_backward_pre_hook,
                     linear.register_backward_hook):
        with pytest.raises(dtorch.UnsupportedOpError, match="module backward hooks are not supported"):
            register(lambda *args: None)


def test_meshes_over_the_same_ranks_keep_their_own_dim_names(session):
    """A tensor placed on a "tp" mesh read back the names of a "dp" mesh over the same ranks on
    which a tensor of its shape had been placed before (interned metadata keyed by mesh equality,
    which ignores names), so parallelize_module(..., tp_dim="tp") raised "no mesh dim named 'tp'"
    and fully_shard over "fsdp" of a (fsdp, tp) mesh silently did nothing."""
    dp = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])
    tp = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    assert dtorch.ones(4, device_mesh=dp, placements=[Replicate()]).device_mesh.mesh_dim_names == ("dp",)
    assert dtorch.ones(4, device_mesh=tp, placements=[Replicate()]).device_mesh.mesh_dim_names == ("tp",)
    model = tnn.Sequential(tnn.Linear(4, 8), tnn.Linear(8, 4))
    dtorch.distribute_module(copy.deepcopy(model), dp)
    parallelize_module(copy.deepcopy(model), tp, {"0": ColwiseParallel(), "1": RowwiseParallel()}, tp_dim="tp")
    for names in (["dp", "tp"], ["fsdp", "tp"]):
        mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
        sharded = parallelize_module(copy.deepcopy(model), mesh, plan, tp_dim="tp")
    fully_shard(sharded, "fsdp")
    assert sharded[0].weight.placements == (Shard(1), Shard(0))
    with pytest.raises(dtorch.MeshError, match="no parameter of .* is on a mesh with a dim named 'pp'"):
        fully_shard(dtorch.distribute_module(copy.deepcopy(model), tp), "pp")


def test_a_torch_gru_equals_torch(mesh4):
    """torch.nn.GRU, once refused (torch.gru), runs as dtorch ops (dtorch/nn/recurrent.py; every
    recurrent layer and option is in tests/test_recurrent.py): output and final state equal torch's."""
    torch.manual_seed(3)
    reference = tnn.GRU(8, 8, batch_first=True)
    recurrent = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    x = torch.randn(2, 3, 8)
    output, final = recurrent(dtorch.distribute_tensor(x, mesh4, [Shard(0)]))
    for got, want in zip((output, final), reference(x)):
        torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-5, atol=1e-6)


_MHA_CALLS = {"weights": {}, "no weights": {"need_weights": False}, "padding": {"key_padding_mask": True},
              "causal hint": {"causal": True, "need_weights": False, "is_causal": True},
              "causal mask, weights per head": {"causal": True, "average_attn_weights": False},
              "padding and causal, no weights": {"causal": True, "key_padding_mask": True, "need_weights": False}}


@pytest.mark.usefixtures("strict")   # a batch shard stays one: nothing is gathered
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("call", list(_MHA_CALLS))
def test_torch_multihead_attention_equals_torch(call, batch_first, mesh4):
    """torch.nn.MultiheadAttention's own forward on DTensors (a batch of 8 over 4 ranks) reaches
    dtorch's multi_head_attention_forward: the output, the attention weights and the gradients of
    the input and of every parameter equal torch's, with padding and causal masks (bool and
    float, given as torch tensors), the is_causal hint, and per-head weights."""
    kwargs = dict(_MHA_CALLS[call])
    torch.manual_seed(4)
    reference = tnn.MultiheadAttention(8, 2, batch_first=batch_first)
    module = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    x = torch.randn(8, 5, 8)
    if kwargs.pop("key_padding_mask", False):
        padding = torch.zeros(8, 5, dtype=torch.bool)
        padding[1, 3:] = padding[6, 1:] = True
        kwargs["key_padding_mask"] = padding
    if kwargs.pop("causal", False):   # bool beside a bool padding mask (torch warns on a mix), else float
        causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
        kwargs["attn_mask"] = causal if "key_padding_mask" in kwargs else \
            tnn.Transformer.generate_square_subsequent_mask(5)
    reference_input = (x if batch_first else x.transpose(0, 1)).clone().requires_grad_()
    expected, expected_weights = reference(reference_input, reference_input, reference_input, **kwargs)
    dx = dtorch.distribute_tensor(x, mesh4, [Shard(0)]).requires_grad_()
    given = dx if batch_first else dx.transpose(0, 1)
    output, weights = module(given, given, given, **kwargs)
    torch.testing.assert_close(output.to_torch(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert (weights is None) == (expected_weights is None)
    if weights is not None:
        torch.testing.assert_close(weights.to_torch(), expected_weights.detach(), rtol=1e-5, atol=1e-6)
    (expected * expected).sum().backward()
    (output * output).sum().backward()
    grad = dx.grad.to_torch()
    torch.testing.assert_close(grad if batch_first else grad.transpose(0, 1), reference_input.grad,
                               rtol=1e-4, atol=1e-5)
    for (name, got), (_, want) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_torch_transformer_encoder_layer_trains_as_torch_does(mesh22):
    """torch.nn.TransformerEncoderLayer (its own forward: MultiheadAttention, norms, feed-forward)
    on dp x tp with the feed-forward Megatron-split by a torch plan: 3 SGD steps with a padding
    mask give torch's losses, then its eval-mode output (torch's own runs its fast path there)."""
    torch.manual_seed(5)
    reference = tnn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    layer = copy.deepcopy(reference)
    parallelize_module(layer, mesh22, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}, tp_dim="tp")
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(4, 5, 8, generator=g) for _ in range(3)]
    padding = torch.zeros(4, 5, dtype=torch.bool)
    padding[2, 4:] = True
    # SGD, not Adam: the key projection's bias gets a zero gradient in exact arithmetic (softmax
    # ignores a shift shared by a row's scores), so Adam would turn rounding noise into full steps
    opt = dtorch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x in batches:
        loss = layer(dtorch.distribute_tensor(x, mesh22, [Shard(0), Replicate()]),
                     src_key_padding_mask=padding).pow(2).mean()
        expected = reference(x, src_key_padding_mask=padding).pow(2).mean()
        _step((opt, loss), (reference_opt, expected))
        torch.testing.assert_close(loss.item(), expected.item(), rtol=2e-4, atol=0)
    layer.eval()
    reference.eval()
    x = batches[0]
    torch.testing.assert_close(layer(dtorch.distribute_tensor(x, mesh22, [Shard(0), Replicate()])).to_torch(),
                               reference(x).detach(), rtol=1e-4, atol=1e-5)


def test_a_distributed_torch_model_checkpoints_and_reshards(mesh4, mesh22, tmp_path):
    """dtorch.checkpoint saves the distributed torch model's state_dict (torch's keys, each worker
    writing its shards) and loads it into the same model distributed on another layout; its
    output equals torch's, and the file converts to a plain torch state_dict torch loads."""
    torch.manual_seed(7)
    reference = TinyLM()
    saved = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    fully_shard(saved, "dp")
    dtorch.checkpoint.save({"model": saved.state_dict()}, tmp_path / "ckpt")
    target = TinyLM()   # other random weights
    parallelize_module(target, mesh22, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}, tp_dim="tp")
    state = dtorch.checkpoint.load({"model": target.state_dict()}, tmp_path / "ckpt")
    target.load_state_dict(state["model"])
    ids = torch.randint(0, 23, (4, 5))
    got = target(dtorch.distribute_tensor(ids, mesh22, [Shard(0), Replicate()])).to_torch()
    torch.testing.assert_close(got, reference(ids).detach(), rtol=1e-5, atol=1e-6)
    plain = dtorch.checkpoint.to_torch_state_dict(tmp_path / "ckpt")["model"]
    fresh = TinyLM()
    fresh.load_state_dict(plain)
    torch.testing.assert_close(fresh(ids), reference(ids), rtol=0, atol=0)


def test_a_torch_cnn_with_batch_norm_trains_as_torch_does(mesh4):
    """torch.nn.Conv2d / BatchNorm2d / MaxPool2d / Linear on a batch over 4 ranks: torch's own
    BatchNorm2d forward computes the batch statistics across ranks and updates its running
    statistics in place (num_batches_tracked too); 2 SGD steps give torch's losses, running
    statistics and eval-mode output."""
    torch.manual_seed(8)
    reference = tnn.Sequential(tnn.Conv2d(3, 4, 3, padding=1), tnn.BatchNorm2d(4), tnn.ReLU(), tnn.MaxPool2d(2),
                               tnn.Flatten(), tnn.Linear(4 * 4 * 4, 5))
    model = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    g = torch.Generator().manual_seed(9)
    images, labels = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    opt = dtorch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = F.cross_entropy(model(dtorch.distribute_tensor(images, mesh4, [Shard(0)])),
                               dtorch.distribute_tensor(labels, mesh4, [Shard(0)]))
        expected = F.cross_entropy(reference(images), labels)
        _step((opt, loss), (reference_opt, expected))
        torch.testing.assert_close(loss.item(), expected.item(), rtol=1e-5, atol=0)
    for name, buffer in reference[1].named_buffers():
        torch.testing.assert_close(getattr(model[1], name).to_torch(), buffer, rtol=1e-5, atol=1e-6, msg=name)
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(dtorch.distribute_tensor(images, mesh4, [Shard(0)])).to_torch(),
                               reference(images).detach(), rtol=1e-4, atol=1e-5)


class _SelfAttention(tnn.Module):
    """nanoGPT's CausalSelfAttention, as written there."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.c_attn, self.c_proj = tnn.Linear(n_embd, 3 * n_embd), tnn.Linear(n_embd, n_embd)
        self.resid_dropout, self.n_head, self.n_embd, self.dropout = tnn.Dropout(dropout), n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _Block(tnn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = (tnn.LayerNorm(n_embd), _SelfAttention(n_embd, n_head, dropout),
                                           tnn.LayerNorm(n_embd))
        self.mlp = tnn.ModuleDict(dict(c_fc=tnn.Linear(n_embd, 4 * n_embd), c_proj=tnn.Linear(4 * n_embd, n_embd)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(tnn.Module):
    """nanoGPT's GPT, trimmed: positions from torch.arange inside forward, weights initialized by
    apply() with torch.nn.init, the head tied to the token embedding, the loss with ignore_index."""

    def __init__(self, vocab: int = 32, block: int = 8, n_embd: int = 16, n_head: int = 2, dropout: float = 0.0):
        super().__init__()
        self.transformer = tnn.ModuleDict(dict(wte=tnn.Embedding(vocab, n_embd), wpe=tnn.Embedding(block, n_embd),
                                               drop=tnn.Dropout(dropout),
                                               h=tnn.ModuleList([_Block(n_embd, n_head, dropout) for _ in range(2)]),
                                               ln_f=tnn.LayerNorm(n_embd)))
        self.lm_head = tnn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, tnn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, tnn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@pytest.mark.parametrize("layout", ["dp2xtp2", "fsdp2xtp2"])
def test_nanogpt_as_written_trains_as_torch_does(layout, mesh22):
    """nanoGPT's model code, unchanged but for dtorch.optim: on dp2 x tp2 with its MLPs
    Megatron-split by a parallelize_module plan, and on fsdp2 x tp2 with its attention split too
    (the packed q/k/v projection column-parallel) and every block fully_shard'ed; 3 AdamW steps
    give torch's losses (the positions torch.arange makes inside forward are uploaded as
    constants). With dropout on, a step runs and draws its masks from dtorch's stream."""
    torch.manual_seed(10)
    reference = NanoGPT()
    model = copy.deepcopy(reference)
    plan = {"transformer.h.*.mlp.c_fc": ColwiseParallel(), "transformer.h.*.mlp.c_proj": RowwiseParallel()}
    if layout == "fsdp2xtp2":
        plan.update({"transformer.h.*.attn.c_attn": ColwiseParallel(),
                     "transformer.h.*.attn.c_proj": RowwiseParallel()})
    parallelize_module(model, mesh22, plan, tp_dim="tp")
    if layout == "fsdp2xtp2":
        for block in model.transformer.h:
            fully_shard(block, "dp")
        fully_shard(model, "dp")
        assert model.transformer.h[0].attn.c_attn.weight.placements == (Shard(1), Shard(0))
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, 32, (4, 9), generator=g) for _ in range(3)]
    opt = dtorch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for batch in batches:
        x, y = batch[:, :-1], batch[:, 1:].clone()
        y[0, -1] = -1
        loss = model(*(dtorch.distribute_tensor(t, mesh22, [Shard(0), Replicate()]) for t in (x, y)))
        expected = reference(x, y)
        _step((opt, loss), (reference_opt, expected))
        torch.testing.assert_close(loss.item(), expected.item(), rtol=2e-4, atol=0)
    _check_parameters(model, reference)
    noisy = dtorch.distribute_module(NanoGPT(dropout=0.2), mesh22)
    x = dtorch.distribute_tensor(batches[0][:, :-1], mesh22, [Shard(0), Replicate()])
    loss = noisy(x, x)
    loss.backward()
    assert torch.isfinite(torch.tensor(loss.item())) and noisy.lm_head.weight.grad is not None


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_with_dropout_stays_causal(need_weights, mesh4):
    """In training with dropout, the causal hint (need_weights=False) and a causal mask (True)
    still hide later positions: changing the last token changes no earlier output, with the same
    dropout draws (the same dtorch seed); and dropout does change the output."""
    torch.manual_seed(12)
    module = dtorch.distribute_module(tnn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True), mesh4)
    x = torch.randn(4, 6, 8)
    changed = x.clone()
    changed[:, -1] = torch.randn(4, 8)
    causal = tnn.Transformer.generate_square_subsequent_mask(6)
    outputs = []
    for value in (x, changed):
        dtorch.manual_seed(3)
        given = dtorch.distribute_tensor(value, mesh4, [Shard(0)])
        outputs.append(module(given, given, given, attn_mask=causal, need_weights=need_weights,
                              is_causal=not need_weights)[0].to_torch())
    assert torch.equal(outputs[0][:, :-1], outputs[1][:, :-1]) and not torch.equal(outputs[0][:, -1], outputs[1][:, -1])
    module.eval()
    plain = dtorch.distribute_tensor(x, mesh4, [Shard(0)])
    assert not torch.allclose(module(plain, plain, plain, attn_mask=causal, need_weights=need_weights,
                                     is_causal=not need_weights)[0].to_torch(), outputs[0])


def test_a_torch_transformer_decoder_layer_equals_torch(mesh4):
    """torch.nn.TransformerDecoderLayer: causal self-attention, then cross-attention on a memory of
    another length (query is not key: three in-projections), on a batch over 4 ranks; the output
    and the gradients of the target, the memory and every parameter equal torch's."""
    torch.manual_seed(13)
    reference = tnn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    layer = dtorch.distribute_module(copy.deepcopy(reference), mesh4)
    target, memory = torch.randn(4, 5, 8), torch.randn(4, 7, 8)
    causal = tnn.Transformer.generate_square_subsequent_mask(5)
    references = [t.clone().requires_grad_() for t in (target, memory)]
    expected = reference(*references, tgt_mask=causal, tgt_is_causal=True)
    inputs = [dtorch.distribute_tensor(t, mesh4, [Shard(0)]).requires_grad_() for t in (target, memory)]
    output = layer(*inputs, tgt_mask=causal, tgt_is_causal=True)
    torch.testing.assert_close(output.to_torch(), expected.detach(), rtol=1e-5, atol=1e-6)
    (output * output).sum().backward()
    (expected * expected).sum().backward()
    for got, want in zip(inputs, references):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5)
    for (name, got), (_, want) in zip(layer.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad.to_torch(), want.grad, rtol=1e-4, atol=1e-5, msg=name)
