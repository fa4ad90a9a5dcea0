"""Llama on a GPU against transformers on the same GPU, for scripts/gpu_check.sh: one part per
run (each in a fresh session), one JSON record of figures written to --json.

  parity    training: tests/test_training.py's small Llama, batches and AdamW settings, trained
            for its STEPS on each --layouts mesh in float32 and bfloat16 (dtorch.nn.mixed_precision)
            against transformers + torch.optim.AdamW on the GPU; float32 losses within 2e-4
            relative, bfloat16 within 2e-2 of the float32 reference (as the CPU test allows)
  generate  greedy generate() on tp2, token for token against transformers' generate
  compiled  the training step as one dtorch.compile'd function (benchmarks/llama_train.py's) on dp2
  fused     the same with dtorch.compile(backend="inductor"), where dtorch.compile takes a backend
  bench     the training step's median seconds on a (1,) mesh against transformers on the GPU

Meshes of 2 ranks need 2 GPUs, or shared-GPU mode (DTORCH_SHARE_GPU=1, which the check sets).
--device cpu runs the same code on CPU workers against transformers on the CPU (a dry run).

    python scripts/gpu_llama.py PART [--device cuda] [--layouts dp2,fsdp2,tp2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch   # noqa: E402

import dtorch   # noqa: E402
from dtorch.spec.placements import init_device_mesh   # noqa: E402
import test_training as training   # noqa: E402  (the CPU suite's model, batches and AdamW settings)
from benchmarks.llama_train import compiled_step   # noqa: E402

transformers = training.transformers
LOSS_TOLERANCE = {"float32": 2e-4, "bfloat16": 2e-2}   # relative, against the float32 reference


class Refused(Exception):
    """The part cannot run here (a missing feature): the check records it as skipped, with this reason."""


def reference_losses(device: str):
    """(initial state_dict on the host, per-step losses) of transformers' training on `device`."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(training.small_config()).to(device)
    initial = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}

    def step(ids):
        ids = ids.to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss
    losses = training.train(model, torch.optim.AdamW(model.parameters(), **training.HYPER), step)
    return initial, [loss.item() for loss in losses]


def dtorch_model(initial: dict, device: str, layout: str, dtype: str = "float32"):
    shape, names = training.LAYOUTS[layout] if layout != "single" else ((1,), ["dp"])
    model = training.LlamaForCausalLM(training.small_config(), device_mesh=init_device_mesh(device, shape,
                                                                                             mesh_dim_names=names))
    model.load_state_dict(initial)
    return dtorch.nn.mixed_precision(model, torch.bfloat16) if dtype == "bfloat16" else model


def worst_relative(got: list, want: list) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def parity(args) -> dict:
    initial, expected = reference_losses(args.device)
    figures, failures = {"reference_losses": expected}, []
    for layout in args.layouts:
        for dtype in ("float32", "bfloat16"):
            model = dtorch_model(initial, args.device, layout, dtype)
            losses = [loss.item() for loss in training.train(model, dtorch.optim.AdamW(model.parameters(),
                                                                                       **training.HYPER))]
            error = worst_relative(losses, expected)
            figures[f"{layout}-{dtype}"] = {"losses": losses, "worst_relative_error": error}
            if error > LOSS_TOLERANCE[dtype]:
                failures.append(f"{layout} {dtype}: relative error {error:.2e} > {LOSS_TOLERANCE[dtype]}")
    return _verdict(figures, failures)


def generate(args) -> dict:
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(training.small_config()).eval()
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    on_device = reference.to(args.device)
    with torch.no_grad():
        expected = on_device.generate(prompt.to(args.device), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, attention_mask=torch.ones_like(prompt, device=args.device))
    model = dtorch_model({k: v.cpu() for k, v in on_device.state_dict().items()}, args.device, "tp2")
    got = model.generate(prompt, max_new_tokens=8, eos_token_id=None)
    same = torch.equal(got.cpu(), expected.cpu())
    return _verdict({"tokens_equal": same}, [] if same else ["generate differs from transformers' tokens"])


def compiled(args, backend: str | None = None) -> dict:
    initial, expected = reference_losses(args.device)
    model = dtorch_model(initial, args.device, "dp2")
    optimizer = dtorch.optim.AdamW(model.parameters(), **training.HYPER)
    step = compiled_step(model, optimizer, backend)
    losses = [step(model._upload(ids)).item() for ids in training.batches()]
    error = worst_relative(losses, expected)
    failures = [] if error <= LOSS_TOLERANCE["float32"] else [f"relative error {error:.2e}"]
    return _verdict({"losses": losses, "worst_relative_error": error}, failures)


def bench(args) -> dict:
    """Median seconds of a training step (forward, backward, AdamW, zero_grad, and a wait for
    the device) after two warm-up steps, dtorch on a (1,) mesh against transformers."""
    initial, _ = reference_losses(args.device)
    ids = training.batches()[0]
    reference = transformers.LlamaForCausalLM(training.small_config()).to(args.device)
    reference.load_state_dict(initial)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), **training.HYPER)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def torch_step():
        on_device = ids.to(args.device)
        reference(on_device, labels=on_device).loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        sync()
    model = dtorch_model(initial, args.device, "single")
    optimizer = dtorch.optim.AdamW(model.parameters(), **training.HYPER)

    def dtorch_step():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dtorch.synchronize()
    ours, theirs = _median_seconds(dtorch_step, args.reps), _median_seconds(torch_step, args.reps)
    return _verdict({"dtorch_step_ms": ours * 1e3, "transformers_step_ms": theirs * 1e3,
                     "ratio": ours / theirs}, [])


def _median_seconds(step, reps: int) -> float:
    for _ in range(2):
        step()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _verdict(figures: dict, failures: list) -> dict:
    return {"status": "failed" if failures else "passed", "failures": failures, "figures": figures}


PARTS = {"parity": parity, "generate": generate, "compiled": compiled,
         "fused": lambda args: compiled(args, backend="inductor"), "bench": bench}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layouts", default="dp2,fsdp2,tp2")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    try:
        record = PARTS[args.part](args)
    except Refused as reason:
        record = {"status": "skipped", "reason": str(reason), "figures": {}}
    finally:
        dtorch.shutdown()
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(record, file)
    return {"passed": 0, "skipped": 0}.get(record["status"], 1)


if __name__ == "__main__":
    sys.exit(main())
