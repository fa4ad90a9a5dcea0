"""Benchmark 10's Llama training step on one layout, phase by phase: forward, backward and the
AdamW step + zero_grad, each timed to dtorch.synchronize(). For A/B runs of two checkouts
(run it with each on PYTHONPATH, alternated) and for seeing which phase a layout pays in.

    PYTHONPATH=<checkout> python -m benchmarks.step_phases [--layout fsdp4] [--steps 8]

Layouts: dp4, fsdp4, fsdp2 (one mesh dim of that name and size). The first two steps warm up.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time


def measure(layout: str, steps: int) -> dict:
    import dtorch
    from dtorch.models import LlamaForCausalLM

    from benchmarks.config import QUICK
    from benchmarks.dp_step_cpu import _fields
    from benchmarks.llama_train import _reference
    dim, size = re.fullmatch(r"([a-z]+)(\d+)", layout).groups()
    reference, ids = _reference(_fields(), QUICK)
    dtorch.init(num_workers=max(2, int(size)))
    try:
        mesh = dtorch.init_device_mesh("cpu", (int(size),), mesh_dim_names=[dim])
        model = LlamaForCausalLM(reference.config, device_mesh=mesh)
        model.load_state_dict(reference.state_dict())
        optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        phases = {"forward": [], "backward": [], "AdamW + zero_grad": [], "step": []}
        for step in range(steps + 2):
            start = time.perf_counter()
            loss = model(ids, labels=ids).loss
            dtorch.synchronize()
            forward = time.perf_counter()
            loss.backward()
            dtorch.synchronize()
            backward = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            dtorch.synchronize()
            end = time.perf_counter()
            if step >= 2:
                for name, seconds in zip(phases, (forward - start, backward - forward, end - backward, end - start)):
                    phases[name].append(seconds)
        return {name: statistics.median(values) for name, values in phases.items()}
    finally:
        dtorch.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="fsdp4", choices=["dp4", "fsdp4", "fsdp2"])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    medians = measure(args.layout, args.steps)
    import dtorch
    print(dtorch.__file__.rsplit("/dtorch/", 1)[0], args.layout, "medians over", args.steps, "steps:",
          ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in medians.items()))


if __name__ == "__main__":
    main()
