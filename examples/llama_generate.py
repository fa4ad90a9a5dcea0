"""Generation with dtorch's Llama on a tensor-parallel (and data-parallel) mesh, greedy or sampled.

    python3 examples/llama_generate.py                      # a small random Llama on 2 local CPU workers
    python3 examples/llama_generate.py --tp 4 --tokens 64   # 4-way tensor parallel
    python3 examples/llama_generate.py --model ./my-llama   # a transformers save_pretrained directory
    dtorch-launch --hostfile hosts examples/llama_generate.py --tp 8
    python3 examples/llama_generate.py --profile trace.json  # a timeline of the timed run (docs/design/profiling.md)
    python3 examples/llama_generate.py --sample --top-p 0.9 --temperature 0.8   # sampled (transformers' warpers)

With --model, every worker reads its own slices of the safetensors files (the directory must be
on a filesystem every host sees); no weight passes through this process. Without it, the model is
random (dtorch.manual_seed), so the tokens are meaningless but the run is the real thing: the KV
cache stays sharded by heads on the workers, and this process only reads each step's token ids.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

import dtorch
from dtorch.models import LlamaForCausalLM
from dtorch.models.llama import LlamaSettings

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, eos_token_id=None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a transformers-format directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--batch", type=int, default=2, help="prompts per batch (default 2)")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--hostfile", help="start workers over SSH (as dtorch-launch does)")
    parser.add_argument("--profile", metavar="TRACE_JSON", help="record the timed generation with dtorch.profile")
    parser.add_argument("--sample", action="store_true", help="sample (do_sample=True) instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    return parser.parse_args(argv)


def build(args, mesh) -> LlamaForCausalLM:
    if args.model:
        return LlamaForCausalLM.from_pretrained(args.model, device_mesh=mesh)
    dtorch.manual_seed(0)
    return LlamaForCausalLM(LlamaSettings(**{**LlamaSettings.DEFAULTS, **SMALL}), device_mesh=mesh)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hostfile:
        dtorch.init(hostfile=args.hostfile)
    mesh = dtorch.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=["dp", "tp"])
    started = time.perf_counter()
    model = build(args, mesh)
    print(f"model on {mesh}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"built in {time.perf_counter() - started:.2f} s")
    prompt = torch.randint(0, model.config.vocab_size, (args.batch * args.dp, args.prompt_length),
                           generator=torch.Generator().manual_seed(0))
    model.generate(prompt, max_new_tokens=2)          # warm-up: plans cached, workers' kernels loaded
    done = [0]

    def progress(_token) -> None:
        done[0] += 1
        if sys.stderr.isatty():
            filled = 30 * done[0] // args.tokens
            sys.stderr.write(f"\rgenerating [{'#' * filled}{'.' * (30 - filled)}] {done[0]}/{args.tokens}")

    recording = dtorch.profile(args.profile) if args.profile else contextlib.nullcontext()
    started = time.perf_counter()
    with recording:
        tokens = model.generate(prompt, max_new_tokens=args.tokens, on_token=progress, do_sample=args.sample,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    elapsed = time.perf_counter() - started
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    new = tokens.shape[1] - prompt.shape[1]
    print(f"generated {new} tokens x {tokens.shape[0]} sequences in {elapsed:.2f} s: "
          f"{new * tokens.shape[0] / elapsed:.1f} tokens/s ({elapsed / new * 1e3:.1f} ms per step)")
    print("first sequence:", tokens[0, prompt.shape[1]:].tolist())
    if args.profile:
        print(f"trace: {args.profile} (python -m dtorch.profile summarize {args.profile})")
    dtorch.shutdown()


if __name__ == "__main__":
    main()
