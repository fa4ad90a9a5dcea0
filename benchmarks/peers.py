"""7. Optional peers, measured only when already installed (never a dependency of dtorch):

- Ray: an actor whose `step()` runs one line of the chain (two ops) on its local tensor.
  "fire-and-forget" times issuing `actor.step.remote()` calls, "sync" times `ray.get` of each
  call; both are reported per op (per call / 2) to line up with the torch eager floor.
- Monarch's tensor engine: the chain on a tensor that lives on a one-process mesh.

Neither is installed on the machine the published table comes from; these code paths are
written against each project's documented API and report an error row if that API moved.
"""
from __future__ import annotations

import importlib.util

from .chain import OPS_PER_LINE, seconds_per_op, torch_eager_per_op
from .timing import Row, failed, guarded, not_installed, repeat, stopwatch

NAME = "peers"
TITLE = "7. Optional peers (only if installed)"
CASE = "(64, 128)"
SHAPE = (64, 128)
EAGER = "torch eager (local)"


def run(suite) -> list[Row]:
    eager = guarded(lambda: Row(NAME, CASE, EAGER, "op", repeat(
        lambda: torch_eager_per_op(SHAPE, suite.chain_ops), suite.reps)), NAME, CASE, EAGER, "op")
    return [eager] + _ray_rows(suite) + [_monarch_row(suite)]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _ray_rows(suite) -> list[Row]:
    variants = ("Ray actor, fire-and-forget", "Ray actor, sync round trip")
    if not _installed("ray"):
        return [not_installed(NAME, CASE, v, "op", "ray") for v in variants]
    try:
        return _measure_ray(suite, variants)
    except Exception as error:  # noqa: BLE001
        return [failed(NAME, CASE, v, "op", error) for v in variants]


def _measure_ray(suite, variants) -> list[Row]:
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(_ChainActor).remote(SHAPE)
        ray.get(actor.step.remote())
        calls = max(1, suite.chain_ops // OPS_PER_LINE)
        fire = repeat(lambda: _ray_fire_and_forget(ray, actor, calls), suite.reps)
        sync = repeat(lambda: _ray_sync(ray, actor, min(calls, 1000)), suite.reps)
        note = f"one call = one `z * 1.0001 + 1` line = {OPS_PER_LINE} ops"
        return [Row(NAME, CASE, variant, "op", [s / OPS_PER_LINE for s in samples],
                    reference=(CASE, EAGER), note=note) for variant, samples in zip(variants, (fire, sync))]
    finally:
        ray.shutdown()


class _ChainActor:
    def __init__(self, shape):
        import torch
        self.z = torch.zeros(shape)

    def step(self):
        self.z = self.z * 1.0001 + 1


def _ray_fire_and_forget(ray, actor, calls: int) -> float:
    elapsed = stopwatch()
    refs = [actor.step.remote() for _ in range(calls)]
    seconds = elapsed() / calls
    ray.get(refs)  # drain untimed
    return seconds


def _ray_sync(ray, actor, calls: int) -> float:
    elapsed = stopwatch()
    for _ in range(calls):
        ray.get(actor.step.remote())
    return elapsed() / calls


def _monarch_row(suite) -> Row:
    variant = "Monarch tensor engine, 1 proc"
    if not _installed("monarch"):
        return not_installed(NAME, CASE, variant, "op", "monarch")
    return guarded(lambda: _measure_monarch(suite, variant), NAME, CASE, variant, "op")


def _measure_monarch(suite, variant: str) -> Row:
    import torch
    from monarch import fetch_shard
    from monarch.actor import this_host
    procs = this_host().spawn_procs(per_host={"procs": 1})
    with procs.activate():
        def once() -> float:
            per_op, z = seconds_per_op(torch.zeros(SHAPE), suite.chain_ops)
            fetch_shard(z).result()  # drain untimed
            return per_op
        samples = repeat(once, suite.reps)
    return Row(NAME, CASE, variant, "op", samples, reference=(CASE, EAGER))

