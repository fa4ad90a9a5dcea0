"""Is the shared test session still usable, and what state is it in? conftest.py asks after a
failed test (and restarts the session when it is broken) and prints the state beside the first
failures, so that a CI log shows why a failure happened and whether it spread."""
from __future__ import annotations

import sys
import threading
import time
import traceback

import torch

import dtorch
from dtorch.spec.placements import Replicate, Shard, init_device_mesh
from dtorch.runtime.controller import session

PROBE_TIMEOUT_S = 60.0


def problem(num_workers: int) -> str | None:
    """Why the shared session can no longer run tests, or None when it can."""
    try:
        controller = session.controller()
    except Exception as error:   # noqa: BLE001 - any reason is the answer
        return f"no session: {error}"
    lost = [f"rank {w.rank}: {w.lost}" for w in controller.workers.values() if w.lost]
    if controller.closed or lost or controller.meshes.lost or controller.tap is not None:
        return (f"closed={controller.closed}, lost workers {lost}, retired meshes "
                f"{list(controller.meshes.lost)}, capture {controller.tap}")
    try:   # one op and one collective on every worker, then a read
        mesh = init_device_mesh("cpu", (num_workers,), mesh_dim_names=["probe"])
        x = (dtorch.arange(2 * num_workers, device_mesh=mesh, placements=[Shard(0)]) + 1).redistribute(mesh,
                                                                                                     [Replicate()])
        if not torch.equal(x.fetch().result(timeout=PROBE_TIMEOUT_S), torch.arange(2 * num_workers) + 1):
            return "a probe op returned a wrong value"
    except Exception as error:   # noqa: BLE001 - any failure of the probe is the answer
        return f"a probe op failed: {error!r}"
    return None


def describe() -> str:
    """The shared session's bookkeeping and every thread's stack, as text."""
    try:
        controller = session.controller()
    except Exception as error:   # noqa: BLE001
        return f"(no session: {error})"
    now = time.monotonic()
    lines = ["--- dtorch session state:"]
    for rank, w in sorted(controller.workers.items()):
        exit_code = w.handle.poll() if w.handle is not None else None
        lines.append(f"  rank {rank}: pid {w.pid} exit {exit_code} lost {w.lost!r} busy #{w.busy_seq} for "
                     f"{w.busy_s:.1f}s, heartbeat {now - w.last_heartbeat:.1f}s ago")
    lines.append(f"  closed {controller.closed}, retired meshes {list(controller.meshes.lost)}, capture "
                 f"{controller.tap}, strict {dtorch.is_strict()}")
    lines.append(f"  next seq {controller._next_seq}, published up to {controller.published_upto}, "
                 f"{len(controller._pending)} pending, pending reads {sorted(controller.reads.pending)[:20]}")
    unreported = [f"#{f.seq} {f.op} {f.exception_type}" for f in controller.reads.unread_failures()]
    lines.append(f"  unreported failures {unreported[:10]}")
    lines.append(f"  locks held: publish {controller._publish_lock.locked()}, submit {controller._lock.locked()}; "
                 f"{controller.receiver.describe()}")
    lines.append("--- threads:")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident() or names.get(ident, "").startswith(("output [", "dtorch-zygote")):
            continue   # this very call, the workers' output pipes, the fork server
        lines.append(f"  thread {names.get(ident, ident)}:")
        lines.extend("    " + line.rstrip() for line in traceback.format_stack(frame)[-8:])
    return "\n".join(lines)
