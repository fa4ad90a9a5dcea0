"""7. Optional peers, measured only when installed (never a dependency of dtorch; install them
with `pip install 'dtorch[peers]'`, see docs/design/benchmarks.md "Peers"):

- Ray: an actor whose `step()` runs one line of the chain (two ops) on its local tensor.
  "fire-and-forget" times issuing `actor.step.remote()` calls, "sync" times `ray.get` of each
  call; both are reported per op (per call / 2) to line up with the torch eager floor.
- Monarch (`torchmonarch`): the same actor on a one-process mesh (`broadcast()` is fire and
  forget, `call_one().get()` the round trip), and its tensor engine: the chain on a tensor that
  lives on a one-process mesh, fetched at the end.

Monarch's tensor engine sets each worker's CUDA_VISIBLE_DEVICES from the mesh: with no dim
named "gpus" it takes `rank % torch.cuda.device_count()`, which on a CPU-only machine raises
ZeroDivisionError inside the worker (monarch/mesh_controller.py, _initialize_env) and the
controller then waits forever. The mesh here names its one dim "gpus", so the worker gets
CUDA_VISIBLE_DEVICES=0 and runs on the CPU.
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
    return [eager] + _ray_rows(suite) + _monarch_rows(suite)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


RAY_VARIANTS = ("Ray actor, fire-and-forget", "Ray actor, sync round trip")
MONARCH_VARIANTS = ("Monarch actor, fire-and-forget", "Monarch actor, sync round trip", "Monarch tensor engine, 1 proc")


def _ray_rows(suite) -> list[Row]:
    variants = RAY_VARIANTS
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


MONARCH_TIMEOUT_S = 120   # a Monarch call that takes longer fails the row instead of hanging the suite


def _monarch_rows(suite) -> list[Row]:
    variants = MONARCH_VARIANTS
    if not _installed("monarch"):
        return [not_installed(NAME, CASE, v, "op", "monarch") for v in variants]
    return _monarch_actor_rows(suite, variants[:2]) + [
        guarded(lambda: _measure_monarch_engine(suite, variants[2]), NAME, CASE, variants[2], "op")]


def _monarch_actor_rows(suite, variants) -> list[Row]:
    try:
        from monarch.actor import this_host
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            actor = procs.spawn("chain", _monarch_actor_class(), SHAPE)
            actor.step.call_one().get(timeout=MONARCH_TIMEOUT_S)
            calls = max(1, suite.chain_ops // OPS_PER_LINE)
            fire = repeat(lambda: _monarch_fire_and_forget(actor, calls), suite.reps)
            sync = repeat(lambda: _monarch_sync(actor, min(calls, 1000)), suite.reps)
        finally:
            procs.stop().get(timeout=MONARCH_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001
        return [failed(NAME, CASE, v, "op", error) for v in variants]
    note = f"one call = one `z * 1.0001 + 1` line = {OPS_PER_LINE} ops"
    return [Row(NAME, CASE, variant, "op", [s / OPS_PER_LINE for s in samples], reference=(CASE, EAGER), note=note)
            for variant, samples in zip(variants, (fire, sync))]


def _monarch_actor_class():
    """Monarch's actor holding the chain's tensor (defined on first use: monarch is optional)."""
    from monarch.actor import Actor, endpoint

    class ChainActor(Actor):
        def __init__(self, shape):
            import torch
            self.z = torch.zeros(shape)

        @endpoint
        def step(self) -> None:
            self.z = self.z * 1.0001 + 1

        @endpoint
        def ready(self) -> bool:
            return True
    return ChainActor


def _monarch_fire_and_forget(actor, calls: int) -> float:
    elapsed = stopwatch()
    for _ in range(calls):
        actor.step.broadcast()
    seconds = elapsed() / calls
    actor.ready.call_one().get(timeout=MONARCH_TIMEOUT_S)  # drain untimed (messages arrive in order)
    return seconds


def _monarch_sync(actor, calls: int) -> float:
    elapsed = stopwatch()
    for _ in range(calls):
        actor.step.call_one().get(timeout=MONARCH_TIMEOUT_S)
    return elapsed() / calls


def _measure_monarch_engine(suite, variant: str) -> Row:
    import torch
    from monarch import fetch_shard
    from monarch.actor import this_host
    # "gpus", not "procs": see the module's docstring (a CPU-only machine would divide by zero)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    ops = min(suite.chain_ops, 2_000)   # ~1 ms per op: the full chain would take minutes
    try:
        with procs.activate():
            def once() -> float:
                per_op, z = seconds_per_op(torch.zeros(SHAPE), ops)
                fetch_shard(z).result(timeout=MONARCH_TIMEOUT_S)  # drain untimed
                return per_op
            samples = repeat(once, suite.reps)
    finally:
        procs.stop().get(timeout=MONARCH_TIMEOUT_S)
    return Row(NAME, CASE, variant, "op", samples, reference=(CASE, EAGER), note=f"chain of {ops} ops")
