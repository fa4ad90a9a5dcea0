"""What a causal language model returns, how its loss is counted and how it decodes: the output
tuple (as transformers' CausalLMOutputWithPast, as far as dtorch fills it), the token
cross-entropy, whole (causal_lm_loss) or as a sum and a count that microbatches add up
(token_losses), and generation with a KV cache on the workers, greedy or sampled (GreedyDecoding;
sampling.py draws the tokens)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..nn import functional as F
from ..ops.tensor_meta import is_local_tensor
from ..dtensor.tensor import DTensor
from .llama_config import mesh_dim
from .sampling import sample_next

__all__ = ["CausalLMOutput", "GreedyDecoding", "causal_lm_loss", "token_losses", "token_loss_sum", "token_count"]


class CausalLMOutput(NamedTuple):
    """What transformers returns, as far as dtorch fills it: `out.logits`, `out.loss`, and
    `out[0]` / tuple unpacking over the fields that are set (loss first when there is one)."""
    loss: DTensor | None
    logits: DTensor
    past_key_values: list | None = None

    def __getitem__(self, index):
        return tuple([v for v in tuple.__iter__(self) if v is not None])[index]


def causal_lm_loss(logits: DTensor, labels: DTensor, ignore_index: int = -100) -> DTensor:
    """Mean cross-entropy over the labels that are not ignore_index, in float32 as transformers
    computes it. With the vocabulary sharded (tp) it never gathers the logits: the max, the sum
    of exponentials and the target's logit are each a small all-reduce over (batch, sequence)."""
    total, count = token_losses(logits, labels, ignore_index)
    return total / count


def token_losses(logits: DTensor, labels: DTensor, ignore_index: int = -100) -> tuple[DTensor, DTensor]:
    """(sum of the token losses, number of counted tokens): causal_lm_loss before its division,
    so that microbatches add up to the batch's mean."""
    return token_loss_sum(logits, labels, ignore_index), token_count(labels, ignore_index)


def token_loss_sum(logits: DTensor, labels: DTensor, ignore_index: int = -100) -> DTensor:
    """The sum of the token losses, in float32; a pending sum until it is read."""
    return F.class_sharded_losses(logits.float(), labels, logits.ndim - 1, ignore_index).sum()


def token_count(labels: DTensor, ignore_index: int = -100) -> DTensor:
    """The number of counted tokens, all-reduced (a scalar)."""
    return (labels != ignore_index).to(torch.float32).sum().reduce_partials()


class GreedyDecoding:
    """generate() for a model with `_forward_one(ids, cache)` (logits of one forward that extends
    `cache`, a list per layer), `_upload(ids)`, `mesh`, `stages`, `model.layers` and `config`."""

    def generate(self, input_ids, max_new_tokens: int = 20, do_sample: bool = False, eos_token_id=None,
                 pad_token_id=None, on_token=None, temperature: float = 1.0, top_k: int | None = 50,
                 top_p: float = 1.0, generator=None) -> torch.Tensor:
        """Decoding with a KV cache kept on the workers (sharded over tp by heads), as
        transformers' generate: the prompt plus up to max_new_tokens tokens, each the most likely
        one (do_sample=False) or drawn after transformers' temperature, top_k and top_p
        (do_sample=True, from dtorch's random stream: dtorch.manual_seed, or `generator`).
        Finished sequences (eos) are padded with pad_token_id; reading each step's tokens is the
        only wait, and only when there is an eos to watch for."""
        if mesh_dim(self.mesh, "cp") is not None or len(self.stages) > 1:
            raise NotImplementedError("generate: decoding runs on dp/tp layouts (cp and pp decode one token "
                                      "at a time, which they cannot split); use a mesh without cp and pp")
        eos = eos_token_id if eos_token_id is not None else getattr(self.config, "eos_token_id", None)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        pad = pad_token_id if pad_token_id is not None else getattr(self.config, "pad_token_id", None)
        prompt = torch.as_tensor(input_ids)
        cache: list = [[] for _ in self.model.layers]
        tokens, finished = [], torch.zeros(prompt.shape[0], dtype=torch.bool)
        step_input = prompt
        for _ in range(max_new_tokens):
            logits = self._forward_one(self._upload(step_input) if is_local_tensor(step_input)
                                       else step_input, cache)
            last = logits[:, -1, :]
            chosen = sample_next(last, temperature, top_k, top_p, generator) if do_sample else last.argmax(-1)
            if eos:
                picked = chosen.to_torch()
                if pad is not None:
                    picked = torch.where(finished, torch.full_like(picked, pad), picked)
                finished |= torch.isin(picked, torch.tensor(sorted(eos)))
                tokens.append(picked)
                if on_token:
                    on_token(picked)
                if finished.all():
                    break
                step_input = picked[:, None]
            else:
                tokens.append(chosen)
                if on_token:
                    on_token(chosen)
                step_input = chosen.unsqueeze(1)
        new = [t.to_torch() if isinstance(t, DTensor) else t for t in tokens]
        return torch.cat([prompt] + [t[:, None] for t in new], dim=1)
