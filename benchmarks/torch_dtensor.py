"""6. PyTorch DTensor on the same machine: the chain from benchmark 1 on an S(0) DTensor over 4
Gloo ranks (torch.distributed.tensor), the SPMD alternative most users reach for.

Every rank runs the chain itself; each sample is the slowest rank's per-op time for one
repetition, and the note lists each rank's median. Four ranks share two cores here, so part
of the per-op time is waiting for a core: the same holds for dtorch's workers, but not for
its controller, which is the only process that runs Python per op on the user's behalf.
"""
from __future__ import annotations

from .chain import seconds_per_op, torch_eager_per_op
from .local_ranks import run_ranks
from .timing import Row, failed, guarded, median, repeat

NAME = "torch_dtensor"
TITLE = "6. PyTorch DTensor per-op time (4 Gloo ranks)"
RANKS = 4
EAGER = "torch eager (local)"
DTENSOR = f"torch DTensor S(0), {RANKS} ranks"


def run(suite) -> list[Row]:
    shapes = [tuple(shape) for shape in suite.chain_shapes]
    try:  # one process group for every shape: starting 4 ranks costs more than the chains
        per_rank = run_ranks(_dtensor_rank, RANKS, (shapes, suite.chain_ops, suite.reps), suite.process_timeout_s)
    except Exception as error:  # noqa: BLE001 -- reported on each DTensor row
        per_rank = error
    rows = []
    for shape in shapes:
        case = str(shape)
        rows.append(guarded(lambda: Row(NAME, case, EAGER, "op", repeat(
            lambda: torch_eager_per_op(shape, suite.chain_ops), suite.reps)), NAME, case, EAGER, "op"))
        rows.append(failed(NAME, case, DTENSOR, "op", per_rank) if isinstance(per_rank, Exception)
                    else _dtensor_row(case, [samples[shape] for samples in per_rank]))
    return rows


def _dtensor_row(case: str, per_rank: list[list[float]]) -> Row:
    slowest = [max(samples) for samples in zip(*per_rank)]
    note = "rank medians " + " / ".join(f"{1e6 * median(s):.0f}" for s in per_rank) + " us"
    return Row(NAME, case, DTENSOR, "op", slowest, reference=(case, EAGER), note=note)


def _dtensor_rank(rank: int, world: int, shapes, ops: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for shape in shapes:
        start = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])

        def once() -> float:
            dist.barrier()
            return seconds_per_op(start, ops)[0]
        results[shape] = repeat(once, reps)
    return results
