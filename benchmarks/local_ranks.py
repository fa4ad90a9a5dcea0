"""Run one function on N local processes joined in a Gloo process group: the baselines'
multi-controller (SPMD) programs.

The parent owns the TCP store, so no port is guessed, and owns the processes: whatever happens
(an exception in a rank, a hang, Ctrl-C), every process it started is terminated, then killed.
"""
from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_ranks", "RankFailure"]

HOST = "127.0.0.1"


class RankFailure(RuntimeError):
    """A baseline rank raised, died, or ran past its deadline."""


def run_ranks(target: Callable[..., Any], world: int, args: tuple = (), timeout_s: float = 300) -> list:
    """Return [target(rank, world, *args) for each rank], each computed in its own process.

    `target` must be importable by name (a module-level function): processes are spawned, not
    forked, because the parent may hold dtorch's controller thread and open zmq sockets."""
    import torch.distributed as dist
    store = dist.TCPStore(HOST, 0, world + 1, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(target, rank, world, store.port, args, results))
                 for rank in range(world)]
    try:
        for process in processes:
            process.start()
        return _collect(results, processes, timeout_s)
    finally:
        _stop_all(processes)
        results.cancel_join_thread()
        results.close()


def _rank_main(target, rank, world, port, args, results) -> None:
    try:
        import torch
        import torch.distributed as dist
        # Several ranks share two cores: one intra-op thread each, like dtorch's workers.
        torch.set_num_threads(1)
        store = dist.TCPStore(HOST, port, world + 1, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            results.put((rank, True, target(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _collect(results, processes, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Any] = {}
    while len(by_rank) < len(processes):
        rank, ok, payload = _next_result(results, processes, by_rank, deadline)
        if not ok:
            raise RankFailure(f"baseline rank {rank} failed:\n{payload}")
        by_rank[rank] = payload
    return [by_rank[rank] for rank in range(len(processes))]


def _next_result(results, processes, by_rank, deadline: float):
    while True:
        try:
            return results.get(timeout=1.0)
        except queue_module.Empty:
            pass
        if time.monotonic() > deadline:
            raise RankFailure(f"baseline ranks did not finish in time; ranks reported: {sorted(by_rank)}")
        dead = [rank for rank, process in enumerate(processes)
                if rank not in by_rank and not process.is_alive()]
        if dead:
            try:  # a rank that just exited may have its result still in the pipe
                return results.get(timeout=2.0)
            except queue_module.Empty:
                codes = [processes[rank].exitcode for rank in dead]
                raise RankFailure(f"baseline ranks {dead} exited (codes {codes}) without reporting") from None


def _stop_all(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=3)
        if process.is_alive():
            process.kill()
            process.join(timeout=3)
