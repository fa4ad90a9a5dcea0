"""A Llama model's configuration as dtorch reads it: transformers' LlamaConfig fields (or a
checkpoint's config.json, LlamaSettings, without transformers), the rope frequencies they define,
and which mesh dims a model lays out on (names from MESH_DIMS, any absent or of size 1)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from ..spec.placements import DeviceMesh, Replicate, Shard

__all__ = ["LlamaSettings", "MESH_DIMS", "head_dim", "kv_heads", "rope_parameters", "inverse_frequencies",
           "mesh_dim", "token_placements", "check_mesh"]

MESH_DIMS = ("dp", "fsdp", "pp", "cp", "tp")
_BATCH_DIMS = ("dp", "fsdp")


class LlamaSettings(SimpleNamespace):
    """A LlamaConfig's fields with transformers' defaults, read from a config.json."""
    DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_theta=10000.0, rope_scaling=None, rope_parameters=None, attention_bias=False,
                    mlp_bias=False, pad_token_id=None, bos_token_id=1, eos_token_id=2)

    @classmethod
    def from_json(cls, path: str) -> LlamaSettings:
        with open(path) as file:
            fields = json.load(file)
        return cls(**{**cls.DEFAULTS, **fields})


# --- configuration -----------------------------------------------------------------------------------
def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling."""
    found = getattr(config, "rope_parameters", None)
    if found:
        return dict(found)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


def inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) for the rope types Llama checkpoints use (transformers'
    formulas). A few dozen floats, computed here and uploaded once."""
    params = rope_parameters(config)
    kind, dim = params.get("rope_type", "default"), head_dim(config)
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind in ("default", "dynamic"):   # dynamic equals default up to max_position_embeddings
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, params), 1.0
    raise NotImplementedError(f"rope_type {kind!r} is not supported yet (default, dynamic, linear, llama3 are)")


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


# --- layout --------------------------------------------------------------------------------------
def mesh_dim(mesh: DeviceMesh, name: str) -> int | None:
    names = mesh.mesh_dim_names or ()
    return names.index(name) if name in names and mesh.shape[names.index(name)] > 1 else None


def token_placements(mesh: DeviceMesh) -> list:
    """Token ids (batch, sequence): batch over dp/fsdp, sequence over cp, replicated elsewhere."""
    names = mesh.mesh_dim_names or ()
    return [Shard(0) if n in _BATCH_DIMS else Shard(1) if n == "cp" else Replicate() for n in names] or \
        [Replicate()] * mesh.ndim


def check_mesh(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names
    if mesh.ndim > 1 and not names:
        raise ValueError(f"LlamaForCausalLM: name the dims of {mesh} (from {MESH_DIMS})")
    unknown = [n for n in names or () if n not in MESH_DIMS]
    if unknown:
        raise ValueError(f"LlamaForCausalLM: mesh dim names {unknown} are not among {MESH_DIMS}")
