"""The process-wide session: one controller, its worker pool, and the random-number state.

The first mesh (or dtorch.init) starts it; a larger mesh later grows the local pool; shutdown()
or interpreter exit stops every worker.
"""
from __future__ import annotations

import atexit
import collections
import os
import random
import threading

import torch

from ...errors import MeshError, SessionEndedError
from ...ops.dispatch import warm_up_inference
from ...spec.rng import rng_state_values
from .cluster import LocalSpawner, default_threads, threads_setting, worker_config
from .controller import Controller
from ..devices import gpu_assignment
from . import recovery
from ..transport import LOCAL, CurveKeys, make_curve_keys

__all__ = ["controller", "active", "init", "init_async", "shutdown", "acquire_workers", "workers", "manual_seed",
           "next_random", "reserve_random", "initial_seed", "get_rng_state", "set_rng_state", "replace_lost_workers"]

_lock = threading.RLock()
_controller: Controller | None = None
_spawner = None
_threads: int | None = None   # torch threads per worker the user chose for this session; None: default_threads
# "0" turns CURVE off for a TCP session (dtorch.init(curve=False) does the same), "1" turns it on for
# a local ipc one; docs/design/launcher.md, "Privacy".
ENV_CURVE = "DTORCH_CURVE"
_random = {"seed": random.SystemRandom().getrandbits(63), "counter": 0}


def controller() -> Controller:
    """This process's one Controller (the session): the name every caller uses for it."""
    active = _controller
    if active is None:
        raise SessionEndedError("no dtorch session (none started yet, or dtorch.shutdown() ended it): build a mesh "
                                "with init_device_mesh(...) or call dtorch.init()")
    return active


def active() -> Controller | None:
    """The session's Controller, or None when no session runs (a check that must not start one)."""
    return _controller


def init(num_workers: int | None = None, device_type: str = "cpu", hostfile: str | None = None,
         controller_address: str | None = None, startup_timeout: float = 120.0,
         curve: bool | None = None, hang_timeout_s: float | None = None, slurm: bool | None = None,
         threads_per_worker: int | None = None, share_gpu: bool | None = None) -> Controller:
    """Start the controller and `num_workers` workers (default: the hostfile's slots, SLURM's
    tasks, or 1). If a session runs already, start more workers if it has fewer than
    `num_workers`, and return it.

    device_type: "cpu" (default) or "cuda" (one GPU per worker).
    threads_per_worker: each worker's torch intra-op threads (torch.set_num_threads), local or
    remote. Default: DTORCH_THREADS; else under SLURM the job's --cpus-per-task; else the CPUs
    this process may run on divided by the workers in the pool when a worker starts (at least 1;
    a worker keeps its count when the pool grows). dtorch.workers() shows each worker's count.
    A count other than the running workers' raises ValueError: it applies as workers start.
    startup_timeout: seconds to wait for the workers to register (default 120).
    hostfile: start workers over SSH (also set by dtorch-launch through DTORCH_HOSTFILE).
    slurm: inside a SLURM allocation (salloc, sbatch), one worker per task, each started with srun
    (default: DTORCH_SLURM=1, which dtorch-launch --slurm sets); num_workers defaults to the tasks.
    controller_address: where workers reach this process (default: detected from the hostfile;
    without one, private ipc:// sockets that only this user can open).
    curve: encrypt and authenticate every ZeroMQ channel with fresh CURVE keys. Default: on for
    every TCP session (a hostfile, SLURM, or a controller_address, loopback included), off for
    the private ipc sockets of a local session; DTORCH_CURVE=0 or 1 sets it when curve is None.
    hang_timeout_s: a worker running one command longer than this (a stuck kernel, a collective
    that never completes) is reported lost, naming the command and its line, and ended. Default:
    DTORCH_HANG_TIMEOUT_S, else 600 s; 0 turns the check off.
    share_gpu: let "cuda" workers share GPUs (rank r on GPU r mod the GPUs visible), with their
    collectives over Gloo through host memory instead of NCCL: a test and development mode, to run
    a mesh of 2-4 on one GPU (docs/design/cuda.md). Default: DTORCH_SHARE_GPU=1; else off, and a
    'cuda' mesh with more workers than GPUs raises MeshError."""
    global _threads
    with _lock:
        if _controller is not None:
            _check_same_threads(threads_per_worker)
            _check_same_sharing(share_gpu)
            if num_workers:
                acquire_workers(device_type, num_workers)
            return _controller
        _threads = threads_setting(threads_per_worker)   # a bad value fails before any start
        sharing = gpu_assignment.share_gpu_setting(share_gpu)
        warm_up = threading.Thread(target=warm_up_inference, name="dtorch-warm-up", daemon=True)
        warm_up.start()   # in parallel with the workers' start; joined before init returns
        try:
            _start(num_workers, device_type, hostfile, controller_address, startup_timeout, curve,
                   hang_timeout_s, slurm, sharing)
        except BaseException:
            shutdown()   # a first start that fails (no GPU, a bad host) leaves nothing running
            raise
        finally:
            # Also on failure: a daemon thread still importing torch modules when the
            # interpreter exits aborts it ("terminate called without an active exception").
            warm_up.join()
        return _controller


async def init_async(num_workers: int | None = None, device_type: str = "cpu", **options) -> Controller:
    """`await dtorch.init_async(...)`: dtorch.init on a worker thread, so an asyncio program's
    loop keeps running while workers start. Later meshes of at most this many workers are
    instant; a larger mesh grows the pool (blocking), so ask for enough here."""
    import asyncio
    import functools
    call = functools.partial(init, num_workers, device_type, **options)
    return await asyncio.get_running_loop().run_in_executor(None, call)


def _start(num_workers, device_type, hostfile, controller_address, startup_timeout, curve, hang_timeout_s,
           slurm, share_gpu=False) -> None:
    global _controller, _spawner
    hostfile = hostfile or os.environ.get("DTORCH_HOSTFILE")
    if slurm is None:
        slurm = not hostfile and os.environ.get("DTORCH_SLURM") == "1"
    if slurm:
        _controller, _spawner = _start_slurm(controller_address, curve)
        num_workers = num_workers or _spawner.capacity
    elif hostfile:
        _controller, _spawner = _start_remote(hostfile, controller_address, curve)
        num_workers = num_workers or _spawner.capacity
    else:
        address = controller_address or LOCAL
        _controller = Controller(bind_host=address, curve=_curve_keys(curve, tcp=address is not LOCAL))
        _spawner = LocalSpawner()
    if hang_timeout_s is not None:
        _controller.hang_timeout_s = hang_timeout_s
    _controller.share_gpu = share_gpu   # read as each worker is assigned a GPU and configured
    _grow(device_type, num_workers or 1, startup_timeout)


def _check_same_threads(threads_per_worker: int | None) -> None:
    """dtorch.init(threads_per_worker=N) once workers run: they took their count when they started."""
    if threads_per_worker is None:
        return
    wanted = threads_setting(threads_per_worker)
    running = sorted({w.threads for w in _controller.workers.values() if w.lost is None})
    if wanted != _threads and running != [wanted]:
        raise ValueError(f"dtorch.init(threads_per_worker={wanted}): this session's workers already run "
                         f"{' or '.join(map(str, running))} torch thread(s) each, set when they started. Call "
                         f"dtorch.shutdown() first, then dtorch.init(threads_per_worker={wanted}) before any mesh")


def _check_same_sharing(share_gpu: bool | None) -> None:
    """dtorch.init(share_gpu=...) on a running session: its workers chose their communicator as they started."""
    if share_gpu is None or share_gpu == _controller.share_gpu:
        return
    raise ValueError(f"dtorch.init(share_gpu={share_gpu}): this session runs with share_gpu="
                     f"{_controller.share_gpu}, set when it started. Call dtorch.shutdown() first, then "
                     f"dtorch.init(share_gpu={share_gpu}) before any mesh")


def _curve_keys(curve: bool | None, tcp: bool) -> CurveKeys | None:
    """Fresh keys for a session with CURVE, else None. On by default for every TCP session,
    loopback included (any local user can connect to a TCP port); off only when asked for
    (curve=False, DTORCH_CURVE=0). A LOCAL session's ipc sockets already sit in a directory
    only this user can enter: there it takes curve=True (or DTORCH_CURVE=1)."""
    if curve is None:
        curve = _curve_from_environment()
    if curve is None:
        curve = tcp
    return make_curve_keys() if curve else None


def _curve_from_environment() -> bool | None:
    text = os.environ.get(ENV_CURVE, "").strip().lower()
    if not text:
        return None
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_CURVE}={text!r}: expected 0 (CURVE off) or 1 (CURVE on), or leave it unset "
                     "for the default (on for every TCP session)")


def _start_remote(hostfile: str, controller_address: str | None, curve: bool | None):
    from dtorch_launcher import SshOptions, SshSpawner, controller_host, load_hostfile
    options = SshOptions.from_environment()
    hosts = load_hostfile(hostfile, options)   # syntax, resolution, no host listed twice
    bind = controller_address or os.environ.get("DTORCH_CONTROLLER_ADDRESS") or controller_host(hosts, options)
    spawner = SshSpawner(hosts, options)   # before the controller: a failure here leaves nothing to stop
    return Controller(bind_host=bind, curve=_curve_keys(curve, tcp=True)), spawner


def _start_slurm(controller_address: str | None, curve: bool | None):
    from dtorch_launcher import Allocation, SlurmSpawner, SshOptions
    from dtorch_launcher.slurm import slurm_controller_address
    allocation = Allocation.from_environment()
    bind = (controller_address or os.environ.get("DTORCH_CONTROLLER_ADDRESS")
            or slurm_controller_address(allocation))
    spawner = SlurmSpawner(allocation, SshOptions.from_environment())
    return Controller(bind_host=bind, curve=_curve_keys(curve, tcp=True)), spawner


def acquire_workers(device_type: str, count: int) -> list[int]:
    """Ranks for a mesh of `count` devices, starting or growing the pool when needed."""
    with _lock:
        if _controller is None:
            init(num_workers=count, device_type=device_type)
        ranks = _ranks_of(device_type)
        if len(ranks) < count:
            _grow(device_type, count - len(ranks), 120.0)
            ranks = _ranks_of(device_type)
        return ranks[:count]


def _ranks_of(device_type: str) -> list[int]:
    return sorted(r for r, w in _controller.workers.items()
                  if w.device.split(":")[0] == device_type and w.lost is None)


def _grow(device_type: str, extra: int, timeout: float) -> None:
    capacity = getattr(_spawner, "capacity", None)
    first = len(_controller.workers)
    if capacity is not None and first + extra > capacity:
        where = getattr(_spawner, "capacity_advice",
                        f"the hostfile has {capacity} slots: add hosts or slots to the hostfile")
        raise MeshError(f"a mesh needs {first + extra} workers but {where}")
    check_pool_size = getattr(_spawner, "check_pool_size", None)
    if check_pool_size is not None:
        check_pool_size(first + extra)
    ranks = range(first, first + extra)
    devices = [device_type] * extra
    if device_type != "cpu":  # runtime/devices/gpu_assignment.py: checks at the call, then one GPU per worker
        devices = gpu_assignment.assign_devices(device_type, ranks, _controller, _spawner)
    threads = _threads or default_threads(first + extra)
    handles = []
    for rank, device in zip(ranks, devices):
        config = worker_config(_controller, rank, device, threads, _controller.curve_for_worker(),
                               gloo_host="auto" if capacity is not None else "127.0.0.1",
                               threads_chosen=_threads is not None)
        handles.append(_spawner.spawn(rank, config))
    _controller.add_workers(handles, device_type)
    _controller.wait_registered([h.rank for h in handles], timeout, _progress(handles))
    _controller.meshes.announce()


def replace_lost_workers(timeout: float = 120.0) -> list[dict]:
    """Start a new process for each lost worker, keeping its rank (locally, or over SSH on the
    same hostfile slot), so meshes that named the rank work again. Tensors that lived on a
    mesh holding a lost rank are refused from then on (LostTensorError: rebuild them, e.g. from a
    checkpoint); tensors on meshes of surviving ranks only stay valid. Returns one dict per
    replaced rank: rank, host, pid (the new process), lost_pid, reason; [] if none was lost.
    docs/design/launcher.md, "Recovering from a lost worker"."""
    with _lock:
        return recovery.replace_lost_workers(controller(), _spawner, timeout, _progress)


def _progress(handles):
    """The live start-up display for workers on remote hosts (local ones start in a second)."""
    if isinstance(_spawner, LocalSpawner):
        return None
    from dtorch_launcher import Host, StartupProgress
    # The hosts of THESE workers: a replaced rank or a grown pool may start on any host, while
    # StartupProgress fills the hosts it is given from the first one.
    per_host = collections.Counter(handle.host for handle in handles)
    return StartupProgress(len(handles), [Host(name, slots=count) for name, count in per_host.items()])


def shutdown() -> None:
    """Stop every worker and the controller. A later mesh starts a fresh session."""
    global _controller, _spawner
    with _lock:
        controller, spawner, _controller, _spawner = _controller, _spawner, None, None
    if controller is not None:
        controller.shutdown()
    if getattr(spawner, "close", None):   # the local worker template or the hosts' relays, once the workers are gone
        spawner.close()


def workers() -> list[dict]:
    """rank, host, pid, device, communicator ("gloo", "nccl" or "gloo-shared-gpu": what moves its
    mesh collectives), alive, threads (its torch intra-op threads, as it registered),
    live_tensors and rss_bytes of every worker in the pool (the last two from its latest
    heartbeat, every 0.5 s: they lag the commands just issued)."""
    session = controller()
    return [_described(w.as_dict(), session.share_gpu) for _, w in sorted(session.workers.items())]


def _described(record: dict, share_gpu: bool) -> dict:
    """A worker's record with its communicator beside its device."""
    keys = list(record)
    at = keys.index("device") + 1
    communicator = gpu_assignment.communicator_name(record["device"], share_gpu)
    return {**{k: record[k] for k in keys[:at]}, "communicator": communicator,
            **{k: record[k] for k in keys[at:]}}


def manual_seed(seed: int) -> None:
    """Make random factories reproducible: values depend on the seed and call order only."""
    _random["seed"], _random["counter"] = int(seed), 0


def initial_seed() -> int:
    """The seed of the global stream (dtorch.manual_seed's, else the one drawn at import)."""
    return _random["seed"]


def get_rng_state() -> torch.Tensor:
    """The global stream's state, as torch.get_rng_state gives torch's: a CPU tensor to keep in a
    checkpoint ([seed, calls so far], int64). dtorch.set_rng_state(state) resumes the stream
    there: the random calls after it draw what they drew after the get."""
    with _lock:
        return torch.tensor([_random["seed"], _random["counter"]], dtype=torch.int64)


def set_rng_state(new_state) -> None:
    seed, counter = rng_state_values(new_state, "dtorch.set_rng_state")
    with _lock:
        _random["seed"], _random["counter"] = seed, counter


def next_random() -> tuple[int, int]:
    return reserve_random(1)


def reserve_random(count: int) -> tuple[int, int]:
    """(seed, first counter) of `count` consecutive random calls on the global stream (a
    dtorch.compile replay takes as many as its capture drew)."""
    with _lock:
        counter = _random["counter"]
        _random["counter"] = counter + count
        return _random["seed"], counter


atexit.register(shutdown)
