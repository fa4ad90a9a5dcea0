"""Train a small Llama on the fables in examples/data/, bytes as tokens, on any layout.

    python3 examples/train_llama.py                            # 2 local CPU workers (dp 2), 120 steps
    python3 examples/train_llama.py --dp 2 --tp 2 --bf16       # 4 workers, bf16 compute
    python3 examples/train_llama.py --steps 400 --resume       # continue the run saved in --out
    dtorch-launch --hostfile hosts examples/train_llama.py --fsdp 4 --tp 2

One process (this one) holds the training loop; the parameters, gradients and AdamW state live
sharded on the workers. The mesh is the product of --dp --fsdp --pp --cp --tp. Each step's batch
is a function of the step alone, so a run resumed from a checkpoint (on any layout) sees the batches
an uninterrupted run would, and on the same layout gives exactly its losses. --out DIR gets the
checkpoint (model, optimizer, step, data position, losses so far) and a loss plot, loss.png.
Over dtorch-launch, DIR must be on a filesystem every host mounts at the same path.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import dtorch
from dtorch.checkpoint import load, save
from dtorch.models import LlamaForCausalLM
from dtorch.models.llama import LlamaSettings

from loss_plot import save_loss_plot

CORPUS = Path(__file__).resolve().parent / "data" / "fables.txt"
BOS, EOS = 256, 257                 # the byte-level tokenizer: ids 0-255 are bytes, then the specials
MODEL = dict(vocab_size=258, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS)
MESH_DIMS = ("dp", "fsdp", "pp", "cp", "tp")   # outer to inner: tp ranks are neighbours
OPTIMIZER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CHECKPOINT = "checkpoint"


# --- data -----------------------------------------------------------------------------------------
def encode(text: str) -> torch.Tensor:
    """The token stream: each fable (paragraph) as BOS, its UTF-8 bytes, EOS."""
    ids = []
    for paragraph in text.split("\n\n"):
        ids += [BOS, *paragraph.strip().encode("utf-8"), EOS]
    return torch.tensor(ids, dtype=torch.int64)


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The batch of step `step` (0-based): `batch` windows of `seq` tokens at offsets drawn from a
    generator seeded by (seed, step) alone, so no data position has to be replayed on resume."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq, (batch,), generator=generator)
    return torch.stack([tokens[s:s + seq] for s in starts.tolist()])


def lr_at(step: int, args) -> float:
    """Linear warm-up, then constant: the schedule does not depend on --steps, so a run stopped
    at step k and resumed with a larger --steps follows the uninterrupted run's schedule."""
    return args.lr * min(1.0, (step + 1) / max(args.warmup, 1))


# --- the model, its optimizer, and their state ----------------------------------------------------
def layout(args) -> str:
    return " x ".join(f"{name}{getattr(args, name)}" for name in MESH_DIMS if getattr(args, name) > 1) or "1 worker"


def build_mesh(args):
    sizes = {name: getattr(args, name) for name in MESH_DIMS if getattr(args, name) > 1} or {"dp": 1}
    return dtorch.init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=list(sizes))


def build_model(mesh, seed: int = 0, bf16: bool = False) -> LlamaForCausalLM:
    dtorch.manual_seed(seed)    # layout-invariant: every layout starts from the same weights
    model = LlamaForCausalLM(LlamaSettings(**{**LlamaSettings.DEFAULTS, **MODEL}), device_mesh=mesh)
    return dtorch.nn.mixed_precision(model, torch.bfloat16) if bf16 else model


def make_optimizer(model, lr: float) -> dtorch.optim.AdamW:
    return dtorch.optim.AdamW(model.parameters(), lr=lr, **OPTIMIZER)


def training_state(model, optimizer, step: int, losses: list, data: dict) -> dict:
    """What a checkpoint holds: the model and the optimizer themselves (save and load call their
    state_dict methods), where the random stream is, and plain values. The data position is the
    step: batch_at needs nothing else."""
    return {"model": model, "optim": optimizer, "rng": dtorch.get_rng_state(), "step": step,
            "losses": list(losses), "data": data}


def restore(model, lr: float, directory: Path):
    """(optimizer, state) from the checkpoint at `directory`: one load fills the fresh model and
    optimizer, as torch.distributed.checkpoint does, each on this run's layout whatever the saved
    one, and the random stream goes on where it was."""
    optimizer = make_optimizer(model, lr)
    state = training_state(model, optimizer, 0, [], {})
    load(state, directory)
    dtorch.set_rng_state(state["rng"])
    return optimizer, state


def resume(model, lr: float, directory: Path, data: dict):
    """(optimizer, step, losses so far) from the checkpoint, saying so."""
    optimizer, state = restore(model, lr, directory)
    if state["data"] != data:
        print(f"note: the checkpoint's data settings {state['data']} differ from this run's {data}: "
              "the batches from here on are not those of an uninterrupted run", flush=True)
    print(f"resumed at step {state['step']} from {directory}", flush=True)
    return optimizer, state["step"], state["losses"]


# --- the loop ---------------------------------------------------------------------------------------
class Progress:
    """A bar on stderr when it is a terminal, else a line every `every` steps on stdout."""

    def __init__(self, last: int, tokens_per_step: int, every: int):
        self.last, self.tokens_per_step, self.every = last, tokens_per_step, every
        self.bar = sys.stderr.isatty()
        self.started = self.window_start = time.perf_counter()
        self.window_steps = 0

    def update(self, step: int, loss: float) -> None:
        self.window_steps += 1
        now = time.perf_counter()
        rate = self.window_steps * self.tokens_per_step / max(now - self.window_start, 1e-9)
        if self.bar:
            filled = 30 * step // self.last
            sys.stderr.write(f"\rstep {step}/{self.last} [{'#' * filled}{'.' * (30 - filled)}] "
                             f"loss {loss:.4f}  {rate:,.0f} tokens/s ")
            sys.stderr.flush()
        elif step % self.every == 0 or step == self.last:
            print(f"step {step}/{self.last}  loss {loss:.4f}  {rate:,.0f} tokens/s", flush=True)
        if step % self.every == 0:
            self.window_start, self.window_steps = now, 0

    def close(self) -> float:
        if self.bar:
            sys.stderr.write("\n")
        return time.perf_counter() - self.started


def train_step(model, optimizer, ids: torch.Tensor, lr: float):
    """One AdamW step on the batch `ids`; returns the loss (a DTensor: reading it waits)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(ids, labels=ids).loss
    loss.backward()
    dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train(model, optimizer, tokens, args, first: int, losses: list, out: Path, data: dict) -> None:
    progress = Progress(args.steps, args.batch * args.seq, args.log_every)
    log = open(args.log_json, "a") if args.log_json else None
    for step in range(first, args.steps):
        loss = train_step(model, optimizer, batch_at(tokens, step, args.batch, args.seq, args.seed), lr_at(step, args))
        losses.append(loss.item())   # the only wait: the workers run backward while this returns
        progress.update(step + 1, losses[-1])
        if log:
            log.write(json.dumps({"step": step + 1, "loss": losses[-1], "lr": lr_at(step, args)}) + "\n")
            log.flush()
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(model, optimizer, step + 1, losses, out, data)
    elapsed = progress.close()
    if log:
        log.close()
    done = args.steps - first
    if done:
        print(f"trained steps {first + 1}-{args.steps} in {elapsed:.1f} s "
              f"({done * args.batch * args.seq / elapsed:,.0f} tokens/s): loss {losses[first]:.4f} -> {losses[-1]:.4f}")


def checkpoint(model, optimizer, step: int, losses: list, out: Path, data: dict) -> None:
    started = time.perf_counter()
    save(training_state(model, optimizer, step, losses, data), out / CHECKPOINT)
    print(f"saved checkpoint at step {step} to {out / CHECKPOINT} ({time.perf_counter() - started:.1f} s)",
          flush=True)


def sample(model, args, length: int) -> str:
    """Greedy continuation of a fable's opening (decoding runs on dp/tp layouts only)."""
    prompt = list(b"Once upon a time, a")
    rows = args.dp * args.fsdp   # one row per batch shard
    ids = torch.tensor([[BOS, *prompt]] * rows)
    out = model.generate(ids, max_new_tokens=length)
    return decode(out[0, 1:].tolist())


# --- the command line -------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in MESH_DIMS:   # the mesh is their product; with none given, --dp 2
        parser.add_argument(f"--{name}", type=int, help=f"{name} ranks (default 1; --dp 2 when no dim is given)")
    parser.add_argument("--steps", type=int, default=120, help="train until this step (default 120)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, float32 master weights and state")
    parser.add_argument("--out", default="train_llama_out", help="checkpoint and loss.png (default ./train_llama_out)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: at the end)")
    parser.add_argument("--log-every", type=int, default=20, help="progress line every N steps off a terminal")
    parser.add_argument("--log-json", help="append {step, loss, lr} per step to this file (JSON lines)")
    parser.add_argument("--sample", type=int, default=48, help="bytes to generate at the end (0: none)")
    parser.add_argument("--hostfile", help="start workers over SSH (as dtorch-launch does)")
    args = parser.parse_args(argv)
    given = any(getattr(args, name) for name in MESH_DIMS)
    for name in MESH_DIMS:    # with no dim given: dp 2, two local workers
        setattr(args, name, getattr(args, name) or (1 if given or name != "dp" else 2))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if args.resume and not (out / CHECKPOINT / "checkpoint.json").exists():
        sys.exit(f"--resume: no checkpoint at {out / CHECKPOINT}; run without --resume first")
    if args.hostfile:
        dtorch.init(hostfile=args.hostfile)
    tokens = encode(CORPUS.read_text(encoding="utf-8"))
    data = {"corpus": CORPUS.name, "tokens": len(tokens), "seed": args.seed, "batch": args.batch, "seq": args.seq}
    mesh = build_mesh(args)
    model = build_model(mesh, args.seed, args.bf16)
    print(f"Llama of {sum(p.numel() for p in model.parameters()):,} parameters on {mesh}; "
          f"{len(tokens):,} tokens of {CORPUS.name}", flush=True)
    if args.resume:
        optimizer, first, losses = resume(model, args.lr, out / CHECKPOINT, data)
    else:
        optimizer, first, losses = make_optimizer(model, args.lr), 0, []
    out.mkdir(parents=True, exist_ok=True)
    train(model, optimizer, tokens, args, first, losses, out, data)
    if args.steps > first:
        checkpoint(model, optimizer, args.steps, losses, out, data)
        drawn = save_loss_plot(losses, out / "loss.png", f"train_llama.py, {layout(args)}")
        print(f"loss plot: {out / 'loss.png'} ({drawn})")
    if args.sample and args.pp == 1 and args.cp == 1:
        print("sample:", repr(sample(model, args, args.sample)))
    dtorch.shutdown()


if __name__ == "__main__":
    main()
