"""Llama (transformers' LlamaForCausalLM, same parameter names and numerics) on any layout of a mesh
whose dims are named from "dp", "fsdp", "pp", "cp", "tp" (any may be absent or of size 1):

  dp, fsdp  the batch is sharded; parameters are replicated over dp, sharded over fsdp (fully_shard per layer)
  tp        Megatron: q/k/v/gate/up column-parallel, o/down row-parallel (their partial sums all-reduced
            into the residual stream), vocab-parallel embedding and lm_head; the loss is a
            vocab-parallel cross-entropy that never gathers the logits
  cp        the sequence is sharded; attention is Ulysses (default: q/k/v move sequence -> heads with
            one all-to-all, attend on whole sequences, and move back) or ring (cp_attention="ring":
            key/value blocks travel around the cp ring, nothing is gathered)
  pp        layers are split into stages, each on its sub-mesh of "pp"; activations move between
            stages point-to-point, one microbatch at a time, so stage s works on microbatch m+1
            while stage s+1 works on microbatch m (each worker runs its own commands in order)

The model takes a transformers LlamaConfig, or anything with its attributes (`LlamaSettings.from_json`
reads a checkpoint's config.json without transformers, which dtorch never imports).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
from types import SimpleNamespace

import torch

from ..spec.placements import DeviceMesh, Replicate, Shard
from ..dtensor.factories import full_like, tensor as upload
from ..dtensor.tensor import DTensor, call_op
from .. import nn
from ..autograd import backward, no_grad
from ..dtensor.recording import is_grad_enabled
from ..nn.pipeline_schedule import run_schedule
from ..nn import functional as F
from ..utils.checkpoint import checkpoint
from .causal_lm import CausalLMOutput, GreedyDecoding, token_count, token_loss_sum
from .llama_config import (MESH_DIMS, LlamaSettings, check_mesh, head_dim, inverse_frequencies, kv_heads,
                           mesh_dim as _dim, token_placements)

__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaSettings", "CausalLMOutput", "MESH_DIMS"]



ROPE_TABLES_KEPT = 64   # cos/sin tables kept per (mesh, past, seq, dtype)

def _reduced(tensor: DTensor) -> DTensor:
    """Partial sums (a row-parallel output, a vocab-parallel lookup) all-reduced to Replicate."""
    return tensor.reduce_partials()


# --- the model ------------------------------------------------------------------------------------------
class LlamaMLP(nn.Module):
    def __init__(self, config, mesh: DeviceMesh, dtype):
        super().__init__()
        width, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        common = dict(bias=bias, dtype=dtype, device_mesh=mesh)
        self.gate_proj = nn.ColumnParallelLinear(width, hidden, **common)
        self.up_proj = nn.ColumnParallelLinear(width, hidden, **common)
        self.down_proj = nn.RowParallelLinear(hidden, width, **common)
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r}: dtorch's Llama runs SwiGLU (silu)")

    def forward(self, x):
        return _reduced(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, mesh: DeviceMesh, dtype, cp_attention: str = "ulysses"):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = head_dim(config), config.num_attention_heads, kv_heads(config)
        width, bias = config.hidden_size, config.attention_bias
        common = dict(bias=bias, dtype=dtype, device_mesh=mesh)
        self.q_proj = nn.ColumnParallelLinear(width, self.heads * self.head_dim, **common)
        self.k_proj = nn.ColumnParallelLinear(width, self.kv_heads * self.head_dim, **common)
        self.v_proj = nn.ColumnParallelLinear(width, self.kv_heads * self.head_dim, **common)
        self.o_proj = nn.RowParallelLinear(self.heads * self.head_dim, width, **common)
        self.cp_dim, self.cp_attention = _dim(mesh, "cp"), cp_attention

    def _heads(self, projected: DTensor, batch: int, seq: int) -> DTensor:
        return projected.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, cache: list | None = None):
        batch, seq = x.shape[0], x.shape[1]
        q = self._heads(self.q_proj(x), batch, seq)
        k = self._heads(self.k_proj(x), batch, seq)
        v = self._heads(self.v_proj(x), batch, seq)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            if cache:
                k, v = _cat([cache[0], k], 2), _cat([cache[1], v], 2)
            cache[:] = [k, v]
        attended = self._attend(q, k, v, causal=seq > 1)
        merged = attended.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return _reduced(self.o_proj(merged))

    def _attend(self, q, k, v, causal: bool):
        groups = self.heads // self.kv_heads
        if self.cp_dim is None or q.placements[self.cp_dim] != Shard(2) or self.cp_attention == "ring":
            # ring attention when the sequence is sharded: the op's rule picks it (ops/ring_attention.py)
            if groups > 1 and Shard(1) not in k.placements:
                # whole heads on every rank: the kernel maps query heads to their key/value head itself,
                # as transformers does (no repeated copies of k and v, forward or backward)
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), is_causal=causal)
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        # Ulysses: one all-to-all per tensor moves the cp shards from sequence to heads, so each
        # rank attends whole sequences for some heads; one more all-to-all moves the result back
        to_heads = lambda t: _on_dim(t, self.cp_dim, Shard(1))  # noqa: E731
        out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=causal)
        return _on_dim(out, self.cp_dim, Shard(2))


def _cat(tensors, dim: int) -> DTensor:
    return call_op("cat", (list(tensors),), {"dim": dim})


def _on_dim(tensor: DTensor, mesh_dim: int, placement) -> DTensor:
    placements = list(tensor.placements)
    placements[mesh_dim] = placement
    return tensor.redistribute(placements=placements)


def _rotate_half(x: DTensor) -> DTensor:
    # chunk: one command for both halves, where two x[..., a:b] cost the controller ~2x the time
    first, second = x.chunk(2, dim=-1)
    return _cat([-second, first], -1)


def _repeat_kv(x: DTensor, groups: int) -> DTensor:
    """Each key/value head repeated for the query heads that share it (GQA), as transformers does."""
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x.unsqueeze(2).expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, mesh: DeviceMesh, dtype, cp_attention: str = "ulysses"):
        super().__init__()
        self.self_attn = LlamaAttention(config, mesh, dtype, cp_attention)
        self.mlp = LlamaMLP(config, mesh, dtype)
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, device_mesh=mesh)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, **norm)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, **norm)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, stages: list[DeviceMesh], dtype, cp_attention: str = "ulysses"):
        super().__init__()
        layers = config.num_hidden_layers
        self.stage_of_layer = [i * len(stages) // layers for i in range(layers)]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id, dtype=dtype,
                                         device_mesh=stages[0], tp_shard_type="vocab")
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, stages[s], dtype, cp_attention)
                                     for s in self.stage_of_layer])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, device_mesh=stages[-1])


class LlamaForCausalLM(GreedyDecoding, nn.Module):
    """transformers' LlamaForCausalLM on a dtorch mesh. `model(input_ids)` takes a torch LongTensor
    (uploaded with the batch over dp/fsdp and the sequence over cp) or a DTensor; `labels=` adds
    transformers' shifted mean cross-entropy as `.loss`."""

    def __init__(self, config, device_mesh: DeviceMesh, *, dtype: torch.dtype | None = None,
                 microbatches: int | None = None, cp_attention: str = "ulysses"):
        super().__init__()
        check_mesh(device_mesh)
        if cp_attention not in ("ulysses", "ring"):
            raise ValueError(f"cp_attention must be 'ulysses' or 'ring', got {cp_attention!r}")
        self.config, self.mesh = config, device_mesh
        self.stages = device_mesh.unbind("pp") if _dim(device_mesh, "pp") is not None else [device_mesh]
        self.microbatches = microbatches or len(self.stages)
        self.model = LlamaModel(config, self.stages, dtype, cp_attention)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                               device_mesh=self.stages[-1])
        if self.tied:   # one Parameter under both names, on the first stage (see _tied_head_on_last_stage)
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq, self.attention_scaling = inverse_frequencies(config)
        self.gradient_checkpointing = False   # transformers' flag: gradient_checkpointing_enable()
        if _dim(device_mesh, "fsdp") is not None:   # parameters sharded over fsdp, gathered per layer
            for layer in self.model.layers:
                nn.fully_shard(layer, "fsdp")
            nn.fully_shard(self, "fsdp")

    # --- forward ----------------------------------------------------------------------------------------
    def forward(self, input_ids, labels=None, past_key_values: list | None = None) -> CausalLMOutput:
        chunks = self._microbatches(input_ids) if past_key_values is None else [self._upload(input_ids)]
        with self._tied_head_on_last_stage():
            logits = [self._forward_one(chunk, past_key_values) for chunk in chunks]
        loss = None
        if labels is not None:   # per microbatch, then one mean: the logits are never concatenated for it
            rows = [0] + list(itertools.accumulate(chunk.shape[0] for chunk in chunks))
            labels = labels if isinstance(labels, DTensor) else torch.as_tensor(labels)
            uploaded = [self._upload_labels(labels[start:end], part)
                        for part, start, end in zip(logits, rows, rows[1:])]
            total = functools.reduce(operator.add, [token_loss_sum(part, up) for part, up in zip(logits, uploaded)])
            # labels given here: their count is known here, so the workers need not all-reduce it
            count = (functools.reduce(operator.add, [token_count(up) for up in uploaded]) if isinstance(labels, DTensor)
                     else int((labels[:, 1:] != -100).sum()))
            loss = total / count
        logits = logits[0] if len(logits) == 1 else _cat(logits, 0)
        return CausalLMOutput(loss, logits, past_key_values)

    def _forward_one(self, ids: DTensor, cache: list | None) -> DTensor:
        steps = self._stage_steps(ids, cache)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def _stage_steps(self, ids: DTensor, cache: list | None = None):
        """One microbatch's forward, a stage at a time: yields after each stage but the last (a
        pipeline schedule issues the stages when it chooses) and returns the logits."""
        past = cache[0][0].shape[2] if cache and cache[0] else 0
        h = _reduced(self.model.embed_tokens(ids))
        stage, rope = 0, self._rope(self.stages[0], past, ids.shape[1], h.dtype)
        for index, layer in enumerate(self.model.layers):
            target = self.model.stage_of_layer[index]
            if target != stage:
                yield
                stage = target
                h = h.redistribute(self.stages[stage], h.placements)
                rope = self._rope(self.stages[stage], past, ids.shape[1], h.dtype)
            if self.gradient_checkpointing and self.training and cache is None:
                h = checkpoint(layer, h, *rope)
            else:
                h = layer(h, *rope, cache[index] if cache is not None else None)
        return self.lm_head(self.model.norm(h))

    # --- activation checkpointing, transformers' spelling ----------------------------------------------
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """In training mode, each decoder layer keeps its input only and runs again in backward
        (dtorch.utils.checkpoint: docs/design/training.md, "Activation checkpointing"); an fsdp layer
        gathers its parameters again there. transformers' kwargs (use_reentrant) change nothing."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.gradient_checkpointing

    # --- training with a pipeline schedule -------------------------------------------------------------
    def forward_backward(self, input_ids, labels, schedule: str = "1f1b") -> DTensor:
        """The loss of `input_ids` against `labels` (as forward's), with its backward already run,
        microbatch by microbatch in a pipeline schedule's order: "1f1b" (each stage holds at
        most stages - s microbatches in flight) or "gpipe" (all forwards, then each microbatch's
        backward stage by stage, so the stages overlap in backward too, which loss.backward() on
        the summed loss cannot: its last stage runs every microbatch in one command). Gradients
        accumulate into the parameters as loss.backward() would leave them. Returns the loss
        (it carries no graph: do not call backward on it)."""
        args = (input_ids,)
        for hook in self._forward_pre_hooks.values():   # fully_shard and mixed_precision gather/cast
            hook(self, args)
        try:
            chunks = self._microbatches(input_ids)
            labels = labels.to_torch() if isinstance(labels, DTensor) else torch.as_tensor(labels)
            rows = [0] + list(itertools.accumulate(chunk.shape[0] for chunk in chunks))
            counted = int((labels[:, 1:] != -100).sum())   # the batch's denominator, known here
            parts = [labels[start:end] for start, end in zip(rows, rows[1:])]

            def finish(k, logits):
                return token_loss_sum(logits, self._upload_labels(parts[k], logits)) / counted
            with self._tied_head_on_last_stage(accumulated=True) as head:
                losses = run_schedule(len(self.stages), [self._stage_steps(chunk) for chunk in chunks], finish,
                                      schedule)
            if head is not None and head.landed.requires_grad:   # the head's part of the tied gradient,
                backward([head.source], [head.landed.grad])           # summed over the microbatches
        finally:
            for hook in self._forward_hooks.values():
                hook(self, args, None)
        with no_grad():
            return functools.reduce(operator.add, [loss.detach() for loss in losses])

    @contextlib.contextmanager
    def _tied_head_on_last_stage(self, accumulated: bool = False):
        """Tied embeddings across pipeline stages: lm_head.weight IS the embedding's Parameter (one
        tensor, as in transformers: one state_dict entry per name, one optimizer state, one
        gradient), and it lives on the first stage. For one forward call lm_head projects with
        that weight moved to the last stage by the same transfer that carries activations between
        stages. Recorded, that move is a pipeline hop: backward moves the head's gradient back and
        adds it to the embedding's, so the gradient is the sum of both uses. (Megatron instead
        keeps a copy per stage and all-reduces their gradients before each optimizer step: a hook
        on every step, and a second tensor that checkpoints and updates must keep equal, both hard
        to hide from the user.)

        `accumulated` (forward_backward): the moved weight is a leaf of the last stage instead,
        into which every microbatch's backward accumulates; the caller then runs its backward
        from `source` once, so one transfer each way per call, whatever the microbatch count.
        Yields None when lm_head is not tied across stages."""
        if not (self.tied and len(self.stages) > 1):
            yield None
            return
        # the embedding's current binding: fully_shard's gathered copy or the Parameter itself
        tied = self.lm_head._parameters["weight"]
        as_leaf = accumulated and tied.requires_grad and is_grad_enabled()
        with no_grad() if accumulated else contextlib.nullcontext():   # no_grad: not recorded as a hop
            landed = tied.redistribute(self.stages[-1], tied.placements)
        if as_leaf:
            landed.requires_grad_()
        self.lm_head._parameters["weight"] = landed   # as fully_shard puts its gathered copies in place
        try:
            yield SimpleNamespace(source=tied, landed=landed)
        finally:
            self.lm_head._parameters["weight"] = tied

    def _rope(self, mesh: DeviceMesh, past: int, seq: int, dtype) -> tuple[DTensor, DTensor]:
        """cos and sin for positions past..past+seq, shaped (seq, head_dim) to broadcast over
        (batch, heads, seq, head_dim); sharded over cp like the sequence. Kept per shape: a
        training step uploads none (and dtorch.compile can capture it: no upload inside)."""
        key = (mesh, past, seq, dtype)
        tables = self.__dict__.setdefault("_rope_tables", {})
        if key not in tables:
            if len(tables) >= ROPE_TABLES_KEPT:   # decoding moves `past` every token
                tables.clear()
            tables[key] = self._rope_tables_for(mesh, past, seq, dtype)
        return tables[key]

    def _rope_tables_for(self, mesh: DeviceMesh, past: int, seq: int, dtype) -> tuple[DTensor, DTensor]:
        freqs = torch.outer(torch.arange(past, past + seq, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        placements = [Shard(0) if n == "cp" else Replicate() for n in (mesh.mesh_dim_names or ())] or \
            [Replicate()] * mesh.ndim
        if seq == 1:
            placements = [Replicate()] * mesh.ndim
        return tuple([upload((part * self.attention_scaling).to(dtype), device_mesh=mesh, placements=placements)
                     for part in (emb.cos(), emb.sin())])

    def _upload(self, input_ids) -> DTensor:
        if isinstance(input_ids, DTensor):
            return input_ids
        ids = torch.as_tensor(input_ids)
        placements = token_placements(self.stages[0])
        if ids.shape[1] == 1:   # one new token (decoding): nothing to split over cp
            placements = [Replicate() if p == Shard(1) else p for p in placements]
        return upload(ids, device_mesh=self.stages[0], placements=placements)

    def _upload_labels(self, labels, logits: DTensor) -> DTensor:
        """transformers' shift: position t predicts token t+1; the last position predicts nothing."""
        mesh = logits.device_mesh
        placements = [p if isinstance(p, Shard) and p.dim < 2 else Replicate() for p in logits.placements]
        if isinstance(labels, DTensor) and labels.device_mesh == mesh:   # shifted on the workers: no read
            with no_grad():
                end = full_like(labels[:, :1], -100)
                return call_op("cat", ([labels[:, 1:], end], 1), {}).redistribute(mesh, placements)
        if isinstance(labels, DTensor):
            labels = labels.to_torch()
        shifted = torch.nn.functional.pad(torch.as_tensor(labels)[:, 1:], (0, 1), value=-100)
        return upload(shifted, device_mesh=mesh, placements=placements)

    def _microbatches(self, input_ids) -> list[DTensor]:
        """The batch's microbatches for the pipeline, each uploaded with the batch sharded over
        dp/fsdp (a torch tensor is split here, before the upload, so no microbatch lives on one
        data-parallel rank only)."""
        rows = input_ids.shape[0]
        if len(self.stages) == 1 or self.microbatches <= 1 or rows < 2:
            return [self._upload(input_ids)]
        count = min(self.microbatches, rows)
        if isinstance(input_ids, DTensor):
            return list(input_ids.chunk(count, 0))
        return [self._upload(part) for part in torch.as_tensor(input_ids).chunk(count, 0)]

    # --- loading -----------------------------------------------------------------------------------------
    # load_state_dict is nn.Module's: a tied lm_head.weight is the embedding's Parameter, loaded once
    # from whichever of the two names the state_dict has (save_pretrained drops lm_head.weight)

    @classmethod
    def from_pretrained(cls, directory: str, device_mesh: DeviceMesh, *, dtype: torch.dtype | None = None,
                        progress: bool | None = None, via_controller: bool = False, **kwargs) -> LlamaForCausalLM:
        """A transformers-format directory (config.json + safetensors): each worker reads its own
        slices from the files (dtorch.checkpoint), no weight byte passes through this process.
        via_controller=True reads them here instead, for hosts that do not all see `directory`."""
        config = LlamaSettings.from_json(os.path.join(directory, "config.json"))
        model = cls(config, device_mesh, dtype=dtype, **kwargs)
        model.load_state_dict(directory, progress=progress, via_controller=via_controller)
        return model.eval()   # as transformers' from_pretrained: call .train() to fine-tune
