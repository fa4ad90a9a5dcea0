"""The zoo's known gaps, in one table: (model, layout, check) -> (the exception raised today, why).

Each entry is marked xfail(strict=True, raises=<that exception>): CI stays green while the gap is
there; the fix turns the entry into a failure (XPASS), so that it is removed with the fix; and any
other failure (another exception, or a value off torch's: an AssertionError) still fails. Every
reason names the defect of issue 42 it belongs to and the exact error. Checks: "forward",
"train", "no_read" (test_zoo.py says what each compares)."""
from __future__ import annotations

from dtorch import MeshError

_TORCH_PARALLELIZE = (
    MeshError,
    "issue 42, defect 5 (torch's own parallelize_module on a dtorch mesh): torch.distributed.tensor.parallel."
    "parallelize_module(model, mesh, plan) raises MeshError: DeviceMesh.get_coordinate() on DeviceMesh('cpu', "
    "shape=(2,), ...): this process is the single controller, no rank of the mesh and no member of a process "
    "group, so torch.distributed.tensor's per-rank code (distribute_tensor, distribute_module, parallelize_module, "
    "DTensor.from_local), which builds the calling rank's own shard, cannot run on a dtorch mesh. Write dtorch's "
    "calls with the same arguments: ... dtorch.nn.parallelize_module(model, mesh, plan) (which takes torch's "
    "ColwiseParallel, RowwiseParallel, ... plans as they are)")

KNOWN_GAPS: dict = {
    ("llama", "tp2-torch-parallelize", "forward"): _TORCH_PARALLELIZE,
    ("llama", "tp2-torch-parallelize", "train"): _TORCH_PARALLELIZE,
    ("llama", "tp2-torch-parallelize", "no_read"): _TORCH_PARALLELIZE,
}
