"""9. Starting N local workers: each its own `python -m dtorch.runtime.processes.worker_process`
(DTORCH_ZYGOTE=0, the reference) against forks of the pre-imported worker template
(dtorch/runtime/processes/zygote.py, the default).

Each measurement is a fresh controller in its own process, so nothing is warm. It reports the
seconds from dtorch.init(num_workers=N) until every worker registered, the seconds until a
first op over all N ranks read back (the first command also connects each worker to the Gloo
store), and proportional memory (PSS, /proc/<pid>/smaps_rollup) per worker once the pool is idle:
PSS splits each shared page among the processes mapping it, so it adds up to what the pool
really costs. The template's own PSS is quoted separately.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .timing import Row, guarded

NAME = "worker_start"
TITLE = "9. Starting N local workers (pool start, then memory per worker)"
DIRECT = "python -m per worker (DTORCH_ZYGOTE=0)"
FORKED = "forked from the worker template"
ROOT = Path(__file__).resolve().parent.parent

MEASURE = textwrap.dedent("""
    import json, sys, time
    import dtorch
    from dtorch.spec.placements import Shard, init_device_mesh
    from dtorch.runtime.controller import session
    def pss_kib(pid):
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    n = int(sys.argv[1])
    started = time.perf_counter()
    dtorch.init(num_workers=n)
    registered = time.perf_counter() - started
    mesh = init_device_mesh("cpu", (n,))
    assert dtorch.ones(n, device_mesh=mesh, placements=[Shard(0)]).sum().item() == n
    ready = time.perf_counter() - started
    time.sleep(1.0)   # idle: the first op's pages are touched, heartbeats only
    workers = [pss_kib(w["pid"]) for w in dtorch.workers()]
    template = session._spawner._zygote
    template_kib = pss_kib(template.pid) if template else 0
    dtorch.shutdown()
    print(json.dumps({"registered_s": registered, "ready_s": ready, "worker_pss_kib": workers,
                      "template_pss_kib": template_kib}))
""")


def run(suite) -> list[Row]:
    rows = []
    for world in suite.worker_start_worlds:
        case = f"{world} workers"
        for variant, zygote in ((DIRECT, "0"), (FORKED, "1")):
            rows += _rows(suite, world, case, variant, zygote)
    return rows


def _rows(suite, world: int, case: str, variant: str, zygote: str) -> list[Row]:
    measured: dict = {}

    def start_row() -> Row:
        measured.update(_measure(world, zygote, suite.process_timeout_s))
        reference = None if zygote == "0" else (case, DIRECT)
        return Row(NAME, case, variant, "pool start", [measured["registered_s"]], reference=reference,
                   note=_memory_note(measured, world))

    row = guarded(start_row, NAME, case, variant, "pool start")
    if not measured:
        return [row]
    ready = Row(NAME, case + ", first op read", variant, "pool start", [measured["ready_s"]],
                reference=None if zygote == "0" else (case + ", first op read", DIRECT))
    return [row, ready]


def _measure(world: int, zygote: str, timeout_s: float) -> dict:
    env = dict(os.environ, DTORCH_ZYGOTE=zygote,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", MEASURE, str(world)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {world} workers failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _memory_note(measured: dict, world: int) -> str:
    per_worker = sum(measured["worker_pss_kib"]) / len(measured["worker_pss_kib"]) / 1024
    note = f"PSS {per_worker:.0f} MiB/worker"
    if measured["template_pss_kib"]:
        template = measured["template_pss_kib"] / 1024
        note += f" + template {template:.0f} MiB ({per_worker + template / world:.0f} MiB/worker with it)"
    return note
