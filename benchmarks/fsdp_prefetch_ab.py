"""fully_shard's prefetch on an fsdp4 Llama training step, with and without, in turns, beside
torch FSDP2 eager and FSDP2 + torch.compile (issue 46; docs/design/training.md, "Prefetch").

    python -m benchmarks.fsdp_prefetch_ab [--reps 9] [--world 4] [--backend inductor | none]
                                          [--layers 4] [--hidden 256] [--seq 64] [--batch 8]

Benchmark 10's model and batch (config.QUICK: 4 layers, hidden 256, batch 8 x 64 tokens).
dtorch's two models train on one pool of `--world` workers, one step each in turn (A B A B),
so that a machine whose speed drifts weighs on both alike; a step is timed from the forward
call to dtorch.synchronize(). The torch rows run after, in `--world` Gloo processes
(train_baselines.py: the slowest rank's step after a barrier; the compiled row's first step
cold and warm). Prints one line per row: median and min step time, and the ratio of medians to
"dtorch, prefetch".
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from .config import QUICK
from .llama_forward import config_fields
from .llama_train import WARMUP_STEPS, _reference, no_prefetch
from .local_ranks import run_ranks
from .timing import median
from .train_baselines import COMPILED, train_rank


def dtorch_in_turns(fields: dict, suite, world: int, reps: int) -> dict:
    """{"dtorch, prefetch": [s, ...], "dtorch, no prefetch": [...]}: one step of each in turn."""
    import dtorch
    from dtorch.models import LlamaForCausalLM
    dtorch.init(num_workers=world)
    try:
        mesh = dtorch.init_device_mesh("cpu", (world,), mesh_dim_names=["fsdp"])
        reference, ids = _reference(fields, suite)
        steps = {}
        for name, prefetch in (("dtorch, prefetch", True), ("dtorch, no prefetch", False)):
            model = LlamaForCausalLM(reference.config, device_mesh=mesh)
            model.load_state_dict(reference.state_dict())
            if not prefetch:
                no_prefetch(model)
            steps[name] = _step(model, ids)
        samples: dict = {name: [] for name in steps}
        for rep in range(WARMUP_STEPS + reps):
            for name, step in steps.items():
                seconds = step()
                if rep >= WARMUP_STEPS:
                    samples[name].append(seconds)
        return samples
    finally:
        dtorch.shutdown()


def _step(model, ids):
    import dtorch
    optimizer = dtorch.optim.AdamW(model.parameters(), lr=1e-3)

    def once() -> float:
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dtorch.synchronize()
        return time.perf_counter() - start
    return once


def torch_rows(fields: dict, suite, world: int, reps: int, backend: str | None) -> dict:
    """FSDP2's rows ({name: [s, ...]} and the compiled one's first-step note)."""
    skip = ("DDP", "DDP" + COMPILED, "TP", "TP" + COMPILED)
    ranks = run_ranks(train_rank, world, (fields, suite.train_batch, suite.train_seq, reps, WARMUP_STEPS, skip,
                                          backend), 3600)
    rows, notes = {}, {}
    for key in ("FSDP2", "FSDP2" + COMPILED):
        if key in ranks[0]:
            rows[f"torch {key}"] = [max(step) for step in zip(*(rank[key]["samples"] for rank in ranks))]
            if "cold_s" in ranks[0][key]:
                notes[f"torch {key}"] = (f"first step cold {max(r[key]['cold_s'] for r in ranks):.1f} s, "
                                         f"warm {max(r[key]['warm_s'] for r in ranks):.1f} s")
    return {"rows": rows, "notes": notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend; none: no compiled row")
    parser.add_argument("--layers", type=int, default=QUICK.train_layers)
    parser.add_argument("--hidden", type=int, default=QUICK.train_hidden)
    parser.add_argument("--seq", type=int, default=QUICK.train_seq)
    parser.add_argument("--batch", type=int, default=QUICK.train_batch)
    args = parser.parse_args()
    suite = replace(QUICK, train_layers=args.layers, train_hidden=args.hidden, train_seq=args.seq,
                    train_batch=args.batch)
    fields = config_fields(replace(suite, llama_layers=suite.train_layers, llama_hidden=suite.train_hidden,
                                   llama_seq=suite.train_seq))
    print(f"fsdp{args.world} Llama training step: {suite.train_layers} layers, hidden {suite.train_hidden}, "
          f"batch {suite.train_batch} x {suite.train_seq} tokens, {args.reps} steps each")
    samples = dtorch_in_turns(fields, suite, args.world, args.reps)
    torch_side = torch_rows(fields, suite, args.world, args.reps, None if args.backend == "none" else args.backend)
    samples.update(torch_side["rows"])
    base = median(samples["dtorch, prefetch"])
    for name, values in samples.items():
        note = torch_side["notes"].get(name, "")
        print(f"  {name:<34} median {median(values) * 1e3:7.1f} ms  min {min(values) * 1e3:7.1f} ms  "
              f"{median(values) / base:5.2f}x  {note}")


if __name__ == "__main__":
    main()
