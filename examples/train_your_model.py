"""Your own torch model, unchanged, trained on local CPU workers from one process.

    python3 examples/train_your_model.py                    # 2 workers, data parallel, 40 steps
    python3 examples/train_your_model.py --dp 2 --tp 2      # its MLPs Megatron-split over tp too

`TinyGPT` below is plain torch, written as nanoGPT writes its model (torch.nn layers, a tied head,
F.scaled_dot_product_attention with dropout, positions from torch.arange inside forward). Nothing
in it knows about dtorch: dtorch.distribute_module (or torch's parallelize_module plan) moves its
parameters onto the mesh in place, and the loop below is a torch loop with dtorch.optim.AdamW. It
trains on the fables in examples/data/, bytes as tokens, and prints the loss every 10 steps.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module

from train_llama import CORPUS, batch_at, encode


# --- the model: plain torch -------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        batch, length, width = x.size()
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 258, width: int = 64, heads: int = 4, layers: int = 3, context: int = 64,
                 dropout: float = 0.1):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight    # tied, as GPT-2's
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids, targets):
        positions = torch.arange(ids.size(1), device=ids.device)   # a local tensor: dtorch uploads it
        x = self.drop(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# --- onto the mesh, and a torch training loop ---------------------------------------------------------
def place(model: nn.Module, dp: int, tp: int):
    mesh = dtorch.init_device_mesh("cpu", (dp, tp), mesh_dim_names=["dp", "tp"])
    if tp == 1:
        return mesh, dtorch.distribute_module(model, mesh)           # every parameter Replicate
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    return mesh, parallelize_module(model, mesh, plan, tp_dim="tp")  # torch's plan, on the torch model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    torch.manual_seed(0)    # the weights (torch's init, in this process)
    dtorch.manual_seed(0)   # the dropout masks (dtorch's stream, the same on every layout)
    mesh, model = place(TinyGPT(), args.dp, args.tp)
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens, context = encode(CORPUS.read_text()), 64
    batch_layout = [Shard(0), Replicate()]   # the batch over dp, whole on each tp rank
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        window = batch_at(tokens, step, args.batch, context + 1, seed=0)
        ids, targets = (dtorch.distribute_tensor(t.contiguous(), mesh, batch_layout)
                        for t in (window[:, :-1], window[:, 1:]))
        loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps:
            value = loss.item()   # the one wait: the workers have run every step up to this one
            rate = step * args.batch * context / (time.perf_counter() - started)
            print(f"step {step:4d}  loss {value:.3f}  {rate:,.0f} tokens/s")
    print(f"dp {args.dp} x tp {args.tp}: {type(model).__name__}, parameters on the workers "
          f"({model.blocks[0].up.weight.placements}), {dtorch.stats()['local_tensors_uploaded']} "
          "position tensors uploaded as constants")
    dtorch.shutdown()


if __name__ == "__main__":
    main()
