"""dtorch.models.llama against transformers' own LlamaForCausalLM with the same state_dict: logits
within 1e-4 (float32) and the same loss on every layout, and generate() token for token."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.spec.placements import init_device_mesh
from dtorch.models import LlamaForCausalLM
from dtorch.models.llama import inverse_frequencies

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {   # name -> (mesh shape, mesh dim names)
    "single": ((1,), ["tp"]),
    "dp2": ((2,), ["dp"]),
    "tp2": ((2,), ["tp"]),
    "tp4": ((4,), ["tp"]),          # 2 kv heads over 4 ranks: uneven head shards
    "pp2": ((2,), ["pp"]),
    "cp2": ((2,), ["cp"]),
    "dp2xtp2": ((2, 2), ["dp", "tp"]),
    "tp2xpp2": ((2, 2), ["tp", "pp"]),
    "dp2xtp2xcp2": ((2, 2, 2), ["dp", "tp", "cp"]),
}


def small_config(**overrides):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(small_config()).eval()


def mesh_for(layout: str):
    shape, names = LAYOUTS[layout]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def loaded(reference, mesh, **kwargs) -> LlamaForCausalLM:
    model = LlamaForCausalLM(reference.config, device_mesh=mesh, **kwargs)
    assert model.load_state_dict(reference.state_dict()) == ([], [])
    return model


RING = ["cp2-ring", "dp2xtp2xcp2-ring"]   # the same layouts with cp_attention="ring"


@pytest.mark.parametrize("layout", list(LAYOUTS) + RING)
def test_logits_and_loss_equal_transformers(layout, reference, session):
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids, labels=ids)
    name, _, ring = layout.partition("-")
    out = loaded(reference, mesh_for(name), cp_attention="ulysses" if not ring else "ring")(ids, labels=ids)
    assert (out.logits.to_torch() - expected.logits).abs().max().item() < 1e-4
    assert abs(out.loss.item() - expected.loss.item()) < 1e-5
    assert out[0] is out.loss and out[1] is out.logits


def test_tensor_parallel_never_gathers_the_logits(reference, session):
    model = loaded(reference, mesh_for("dp2xtp2"))
    ids = torch.randint(0, 96, (4, 6))
    out = model(ids, labels=ids)
    assert out.logits.placements == (dtorch.Shard(0), dtorch.Shard(2))   # batch over dp, vocabulary over tp
    assert model.lm_head.weight.placements[1] == dtorch.Shard(0)
    assert model.model.layers[0].self_attn.o_proj.weight.placements[1] == dtorch.Shard(1)
    assert out.loss.item() == pytest.approx(reference(ids, labels=ids).loss.item(), abs=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tied_embeddings_and_llama3_rope(layout, session):
    torch.manual_seed(2)
    config = small_config(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    reference = transformers.LlamaForCausalLM(config).eval()
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}   # as save_pretrained
    model = LlamaForCausalLM(config, device_mesh=mesh_for(layout))
    model.load_state_dict(state)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids).logits.to_torch()
    assert (got - expected).abs().max().item() < 1e-4
    assert model.lm_head.weight is model.model.embed_tokens.weight   # on pp2 too (training: test_training.py)
    expected_freq = reference.model.rotary_emb.inv_freq
    torch.testing.assert_close(inverse_frequencies(config)[0], expected_freq)


@pytest.mark.parametrize("layout", ["single", "tp2", "dp2xtp2"])
def test_generate_equals_transformers_token_for_token(layout, reference, session):
    model = loaded(reference, mesh_for(layout))
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, max_new_tokens=8, eos_token_id=None), expected)


def test_sampled_generation_is_the_same_on_every_layout_and_stays_in_the_top_k(reference, session):
    """do_sample=True: for one dtorch.manual_seed the same tokens on every layout, each among the
    top_k of transformers' own logits for its prefix; top_k=1 is greedy decoding."""
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(5))
    runs = []
    for layout in ("single", "tp2", "dp2xtp2"):
        model = loaded(reference, mesh_for(layout))
        dtorch.manual_seed(7)
        runs.append(model.generate(prompt, max_new_tokens=8, eos_token_id=None, do_sample=True, temperature=1.5,
                                   top_k=4, top_p=0.95))
        assert torch.equal(model.generate(prompt, max_new_tokens=4, eos_token_id=None, do_sample=True, top_k=1),
                           model.generate(prompt, max_new_tokens=4, eos_token_id=None))
    assert all(torch.equal(run, runs[0]) for run in runs), runs
    tokens = runs[0]
    with torch.no_grad():
        logits = reference(tokens).logits
    for position in range(5, tokens.shape[1]):
        top = logits[:, position - 1].topk(4).indices
        assert (top == tokens[:, position, None]).any(-1).all(), position
    assert not torch.equal(tokens, model.generate(prompt, max_new_tokens=8, eos_token_id=None))   # not greedy


def test_generate_stops_at_eos_like_transformers(reference, session):
    model = loaded(reference, mesh_for("tp2"))
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    free = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    eos = int(free[0, 6])             # a token the first sequence produces: it stops there
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                                      pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, max_new_tokens=6, eos_token_id=eos, pad_token_id=0), expected)


def test_bad_meshes_and_unsupported_settings_are_refused(reference, session):
    with pytest.raises(ValueError, match=r"mesh dim names \['ep'\] are not among"):
        LlamaForCausalLM(reference.config, device_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=["ep"]))
    model = LlamaForCausalLM(reference.config, device_mesh=mesh_for("cp2"))
    with pytest.raises(NotImplementedError, match="decoding runs on dp/tp layouts"):
        model.generate(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="rope_type 'yarn' is not supported"):
        inverse_frequencies(small_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))


@pytest.mark.parametrize("layout, tied, via_controller", [("tp2", False, False), ("dp2xtp2", True, False),
                                                          ("pp2", True, False), ("tp2", True, True)])
def test_from_pretrained_reads_a_save_pretrained_directory(layout, tied, via_controller, tmp_path, session):
    torch.manual_seed(5)
    reference = transformers.LlamaForCausalLM(small_config(tie_word_embeddings=tied)).eval()
    reference.save_pretrained(tmp_path)      # config.json + model.safetensors, as on the hub
    before = dtorch.stats()["checkpoint_bytes_via_controller"]
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh_for(layout), via_controller=via_controller)
    ids = torch.randint(0, 96, (4, 7))
    with torch.no_grad():
        expected = reference(ids).logits
    assert (model(ids).logits.to_torch() - expected).abs().max().item() < 1e-4
    through_controller = dtorch.stats()["checkpoint_bytes_via_controller"] - before
    assert (through_controller > 0) == via_controller   # by default the workers read the file themselves


def test_a_module_loads_a_checkpoint_path_and_refuses_a_wrong_one(reference, tmp_path, session):
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = LlamaForCausalLM(reference.config, device_mesh=mesh_for("tp2"))
    assert model.load_state_dict(str(tmp_path)) == ([], [])
    assert torch.equal(model.lm_head.weight.to_torch(), state["lm_head.weight"])
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: 'model.norm.weight'"):
        model.load_state_dict(str(tmp_path))
