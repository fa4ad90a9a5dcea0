"""The zoo: public models from transformers, diffusers, timm and torchvision, each built from a
tiny random config (nothing is downloaded) and called as its library's documentation calls it.

A ZooModel says how to build the torch model, how to make one batch of its inputs (every input's
first dim is the batch, which dp shards), how to call it (its output to compare, its loss), and
the tensor-parallel plan, where it has one, with dtorch.nn's styles (docs/design/models.md)."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtorch.nn import ColwiseParallel, RowwiseParallel

BATCH = 4          # two per rank on dp2
SEQUENCE = 8
VOCAB = 99
IMAGE = (3, 16, 16)
CLASSES = 10


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    library: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], dict]     # keyword -> tensor, batch first
    run: Callable[[torch.nn.Module, dict], tuple]  # (output to compare, scalar loss)
    tp_plan: dict | None = None                    # None: no tensor-parallel plan for it

    @property
    def layouts(self) -> list:
        return ["dp2"] + (["tp2"] if self.tp_plan else [])


def missing(library: str) -> str | None:
    """Why `library` cannot be imported here, or None."""
    try:
        importlib.import_module(library)
    except Exception as error:   # timm fails on torchvision's import, which fails on its own ops
        return f"`import {library}` fails here: {type(error).__name__}: {error}"
    return None


# --- inputs -----------------------------------------------------------------------------------

def _ids(g, batch=BATCH, sequence=SEQUENCE):
    return torch.randint(3, VOCAB, (batch, sequence), generator=g)


def _token_batch(g):
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_batch(g):
    return {"input_ids": _ids(g), "labels": _ids(g, sequence=SEQUENCE - 2)}


def _image_batch(g):
    return {"pixel_values": torch.randn(BATCH, *IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _timesteps(g):
    return torch.randint(0, 1000, (BATCH,), generator=g)


def _latents(g, channels=4, size=8):
    return torch.randn(BATCH, channels, size, size, generator=g)


# --- calls, as each library's docs write them -------------------------------------------------

def _hf_call(model, batch):
    out = model(**batch)
    return out.logits, out.loss


def _unet_call(model, batch):
    # diffusers' training example: noise_pred = unet(noisy_images, timesteps).sample; mse to the noise
    prediction = model(batch["sample"], batch["timestep"]).sample
    return prediction, F.mse_loss(prediction, batch["noise"])


def _conditional_unet_call(model, batch):
    prediction = model(batch["sample"], batch["timestep"], encoder_hidden_states=batch["encoder_hidden_states"]).sample
    return prediction, F.mse_loss(prediction, batch["noise"])


def _dit_call(model, batch):
    prediction = model(batch["sample"], timestep=batch["timestep"], class_labels=batch["class_labels"]).sample
    return prediction, F.mse_loss(prediction, batch["noise"])


def _sd3_call(model, batch):
    prediction = model(batch["sample"], encoder_hidden_states=batch["encoder_hidden_states"],
                       pooled_projections=batch["pooled_projections"], timestep=batch["timestep"]).sample
    return prediction, F.mse_loss(prediction, batch["noise"])


def _pixart_call(model, batch):
    prediction = model(batch["sample"], encoder_hidden_states=batch["encoder_hidden_states"],
                       timestep=batch["timestep"], added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    return prediction, F.mse_loss(prediction, batch["noise"])


def _clip_call(model, batch):
    # transformers' CLIP training: outputs = model(input_ids, pixel_values, return_loss=True); outputs.loss
    out = model(**batch, return_loss=True)
    return out.logits_per_image, out.loss


def _vae_call(model, batch):
    reconstruction = model(batch["sample"]).sample
    return reconstruction, F.mse_loss(reconstruction, batch["sample"])


def _classifier_call(model, batch):
    # timm's and torchvision's: logits = model(images); loss = CrossEntropyLoss()(logits, targets)
    logits = model(batch["images"])
    return logits, F.cross_entropy(logits, batch["targets"])


# --- tensor-parallel plans (Megatron: column-parallel in, row-parallel out) ---------------------

def _plan(prefix: str, colwise: tuple, rowwise: tuple) -> dict:
    return {**{f"{prefix}.{name}": ColwiseParallel() for name in colwise},
            **{f"{prefix}.{name}": RowwiseParallel() for name in rowwise}}


def _llama_like_plan(prefix="model.layers.*"):
    return _plan(prefix, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
                 ("self_attn.o_proj", "mlp.down_proj"))


def _bert_like_plan(prefix):
    return _plan(prefix, ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
                 ("attention.output.dense", "output.dense"))


def _vit_plan():
    return _plan("vit.layers.*", ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
                 ("attention.o_proj", "mlp.fc2"))


def _t5_plan():
    def attention(name):
        return (f"{name}.q", f"{name}.k", f"{name}.v"), (f"{name}.o",)
    encoder_in, encoder_out = attention("layer.0.SelfAttention")
    decoder_in, decoder_out = attention("layer.0.SelfAttention")
    cross_in, cross_out = attention("layer.1.EncDecAttention")
    return {**_plan("encoder.block.*", encoder_in + ("layer.1.DenseReluDense.wi",),
                    encoder_out + ("layer.1.DenseReluDense.wo",)),
            **_plan("decoder.block.*", decoder_in + cross_in + ("layer.2.DenseReluDense.wi",),
                    decoder_out + cross_out + ("layer.2.DenseReluDense.wo",))}


def _bart_plan():
    self_attention = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    cross_attention = ("encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj")
    return {**_plan("model.encoder.layers.*", self_attention + ("fc1",), ("self_attn.out_proj", "fc2")),
            **_plan("model.decoder.layers.*", self_attention + cross_attention + ("fc1",),
                    ("self_attn.out_proj", "encoder_attn.out_proj", "fc2"))}


def _dit_plan(attention="attn1"):
    projections = tuple(f"{attention}.{name}" for name in ("to_q", "to_k", "to_v"))
    return _plan("transformer_blocks.*", projections + ("ff.net.0.proj",), (f"{attention}.to_out.0", "ff.net.2"))


# --- builders ---------------------------------------------------------------------------------

def _transformers(config_name: str, model_name: str, **config):
    def build():
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return build


def _diffusers(model_name: str, **config):
    def build():
        import diffusers
        return getattr(diffusers, model_name)(**config)
    return build


def _dit(**config):
    def build():
        import diffusers
        model = diffusers.DiTTransformer2DModel(**config)
        for module in model.modules():
            if isinstance(module, diffusers.models.embeddings.LabelEmbedding):
                # class-label dropout (for classifier-free guidance) draws from torch's generator on
                # one side and dtorch's random stream on the other: off, so the two can be compared
                module.dropout_prob = 0.0
        return model
    return build


def _timm(name: str, **config):
    def build():
        import timm
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **config)
    return build


def _torchvision_resnet():
    from torchvision.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)     # resnet18's blocks, one per stage


def _torchvision_vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=IMAGE[1], patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=37,
                             num_classes=CLASSES)


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
_NO_DROPOUT_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _noise_batch(g, channels=3, size=16, **extra):
    return {"sample": _latents(g, channels, size), "timestep": _timesteps(g),
            "noise": _latents(g, channels, size), **extra}


def _conditioned_noise_batch(g):
    return _noise_batch(g, 4, 8, encoder_hidden_states=torch.randn(BATCH, 5, 32, generator=g))


def _classifier_batch(g, size=IMAGE[1]):
    return {"images": torch.randn(BATCH, IMAGE[0], size, size, generator=g),
            "targets": torch.randint(0, CLASSES, (BATCH,), generator=g)}


ZOO = [
    # transformers: decoder LMs trained through labels= with their default cache
    ZooModel("gpt2", "transformers", _transformers(
        "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2), _token_batch, _hf_call,
        _plan("transformer.h.*", ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj"))),
    ZooModel("llama", "transformers", _transformers("LlamaConfig", "LlamaForCausalLM", **_DECODER),
             _token_batch, _hf_call, _llama_like_plan()),
    ZooModel("qwen2", "transformers", _transformers("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
             _token_batch, _hf_call, _llama_like_plan()),
    ZooModel("mistral", "transformers", _transformers("MistralConfig", "MistralForCausalLM", **_DECODER),
             _token_batch, _hf_call, _llama_like_plan()),
    ZooModel("phi3", "transformers", _transformers("Phi3Config", "Phi3ForCausalLM", **_DECODER),
             _token_batch, _hf_call,
             _plan("model.layers.*", ("self_attn.qkv_proj", "mlp.gate_up_proj"),
                   ("self_attn.o_proj", "mlp.down_proj"))),
    ZooModel("gemma", "transformers", _transformers("GemmaConfig", "GemmaForCausalLM", head_dim=8, **_DECODER),
             _token_batch, _hf_call, _llama_like_plan()),
    ZooModel("gpt_neox", "transformers", _transformers(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=37,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
        _token_batch, _hf_call,
        _plan("gpt_neox.layers.*", ("attention.query_key_value", "mlp.dense_h_to_4h"),
              ("attention.dense", "mlp.dense_4h_to_h"))),
    ZooModel("opt", "transformers", _transformers(
        "OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=37, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), _token_batch, _hf_call,
        _plan("model.decoder.layers.*", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
              ("self_attn.out_proj", "fc2"))),
    # an encoder, two encoder-decoders, vision models
    ZooModel("bert", "transformers", _transformers(
        "BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, **_NO_DROPOUT_BERT), _token_batch, _hf_call,
        _bert_like_plan("bert.encoder.layer.*")),
    ZooModel("roberta", "transformers", _transformers(
        "RobertaConfig", "RobertaForSequenceClassification", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=37, max_position_embeddings=64, num_labels=CLASSES,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, **_NO_DROPOUT_BERT),
        lambda g: {"input_ids": _ids(g), "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}, _hf_call,
        _bert_like_plan("roberta.encoder.layer.*")),
    ZooModel("t5", "transformers", _transformers(
        "T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0), _seq2seq_batch, _hf_call, _t5_plan()),
    ZooModel("bart", "transformers", _transformers(
        "BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2), _seq2seq_batch, _hf_call, _bart_plan()),
    ZooModel("vit", "transformers", _transformers(
        "ViTConfig", "ViTForImageClassification", image_size=IMAGE[1], patch_size=4, num_channels=3, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, num_labels=CLASSES, **_NO_DROPOUT_BERT),
        _image_batch, _hf_call, _vit_plan()),
    ZooModel("clip", "transformers", _transformers(
        "CLIPConfig", "CLIPModel", text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    max_position_embeddings=SEQUENCE, bos_token_id=1,
                                                    eos_token_id=2, pad_token_id=0),
        vision_config=dict(image_size=IMAGE[1], patch_size=4, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=2), projection_dim=16),
        lambda g: {"input_ids": _ids(g), "pixel_values": torch.randn(BATCH, *IMAGE, generator=g)}, _clip_call),
    ZooModel("swin", "transformers", _transformers(
        "SwinConfig", "SwinForImageClassification", image_size=IMAGE[1], patch_size=2, embed_dim=16, depths=[1, 1],
        num_heads=[2, 2], window_size=4, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0), _image_batch, _hf_call),
    ZooModel("resnet", "transformers", _transformers(
        "ResNetConfig", "ResNetForImageClassification", num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
        depths=[1, 1], layer_type="basic", num_labels=CLASSES), _image_batch, _hf_call),
    ZooModel("convnext", "transformers", _transformers(
        "ConvNextConfig", "ConvNextForImageClassification", num_channels=3, num_stages=2, hidden_sizes=[16, 32],
        depths=[1, 1], num_labels=CLASSES), _image_batch, _hf_call),
    # diffusers: UNets with a tensor timestep, a VAE, diffusion transformers
    ZooModel("unet2d", "diffusers", _diffusers(
        "UNet2DModel", sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, attention_head_dim=8), _noise_batch, _unet_call),
    ZooModel("unet2d_condition", "diffusers", _diffusers(
        "UNet2DConditionModel", sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=8), _conditioned_noise_batch, _conditional_unet_call),
    ZooModel("dit", "diffusers", _dit(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=CLASSES),
        lambda g: {**_noise_batch(g, 4, 8), "class_labels": torch.randint(0, CLASSES, (BATCH,), generator=g)},
        _dit_call, _dit_plan()),
    ZooModel("sd3_transformer", "diffusers", _diffusers(
        "SD3Transformer2DModel", sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16,
        out_channels=4, pos_embed_max_size=16),
        lambda g: {**_conditioned_noise_batch(g), "pooled_projections": torch.randn(BATCH, 16, generator=g)},
        _sd3_call, _dit_plan("attn")),
    ZooModel("pixart_transformer", "diffusers", _diffusers(
        "PixArtTransformer2DModel", sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8,
        num_attention_heads=2, in_channels=4, out_channels=4, cross_attention_dim=16, caption_channels=32,
        norm_num_groups=8, use_additional_conditions=False),
        _conditioned_noise_batch, _pixart_call,
        {**_dit_plan("attn1"), **_dit_plan("attn2")}),
    ZooModel("autoencoder_kl", "diffusers", _diffusers(
        "AutoencoderKL", in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32), latent_channels=4,
        norm_num_groups=8, sample_size=16), lambda g: {"sample": torch.randn(BATCH, *IMAGE, generator=g)}, _vae_call),
    # timm and torchvision
    ZooModel("timm_resnet", "timm", _timm("resnet18", layers=(1, 1, 1, 1)), _classifier_batch, _classifier_call),
    ZooModel("timm_vit", "timm", _timm("vit_tiny_patch16_224", img_size=IMAGE[1], patch_size=4, embed_dim=32, depth=2,
                                       num_heads=2), _classifier_batch, _classifier_call,
             _plan("blocks.*", ("attn.qkv", "mlp.fc1"), ("attn.proj", "mlp.fc2"))),
    # 32x32 images: ConvNeXt's stem divides by 4 and three downsamples by 2 more
    ZooModel("timm_convnext", "timm", _timm("convnext_atto", dims=(16, 32, 48, 64), depths=(1, 1, 1, 1)),
             lambda g: _classifier_batch(g, size=32), _classifier_call),
    ZooModel("torchvision_resnet", "torchvision", _torchvision_resnet, _classifier_batch, _classifier_call),
    ZooModel("torchvision_vit", "torchvision", _torchvision_vit, _classifier_batch, _classifier_call,
             _plan("encoder.layers.*", ("mlp.0",), ("mlp.3",))),
]
