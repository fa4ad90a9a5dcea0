"""A worker's side of RunOp.moves: the redistributes the planner inserted before an op (an input
whose placements the op's rule refuses), run by the op's own command instead of a Redistribute
command each.

Why fused: one command instead of two or more (the issuing thread's CPU per op with a move
halves: docs/design/architecture.md, "Enqueue"), and a moved input (an all-gathered weight, say) lives
only while the op runs, not until the Free of its symbol.

The failure rule is a Redistribute's (MoveCommands._stand_in): every rank joins every collective of
every move, in order, whatever happened here. An input that is poisoned or missing on this rank
joins with zeros of its block; a step that fails joins the rest of its collectives with zeros
(kernels.apply_steps), and the next moves still run. The first failure is returned for the
caller to raise once all of them are done, so the op's outputs are poisoned here and the peers'
results, computed with those zeros, are never readable (a read gathers every rank's status).
"""
from __future__ import annotations

import torch

from ...spec.placements import DeviceMesh, local_region
from ...spec.redistribute import format_steps
from ..devices.comm import Communicator
from .kernels import apply_steps
from ..protocol import dtype_from_name

__all__ = ["run_moves"]


def run_moves(moves: tuple, sources: dict, mesh: DeviceMesh, rank: int, comm: Communicator,
              device: torch.device) -> tuple[dict, Exception | None]:
    """({tensor_index: moved tensor}, the first failure or None). `moves` is RunOp.moves;
    `sources` maps each move's tensor_index to this rank's input, absent where it failed."""
    moved, failure = {}, None
    for index, shape, dtype, placements, steps, grad in moves:
        source = sources.get(index)
        if source is None:
            block = local_region(shape, mesh, placements, mesh.coordinate_of(rank))[1]
            source = torch.zeros(block, dtype=dtype_from_name(dtype), device=device)
        try:
            # as its Redistribute would: recorded for backward only if its input requires grad
            with torch.set_grad_enabled(grad):
                moved[index] = apply_steps(source, shape, mesh, placements, steps, rank, comm)
        except Exception as error:  # noqa: BLE001 -- raised by the caller after the other moves
            # the report's traceback then says the op failed in a move the user did not write
            error.add_note(f"in the redistribute dtorch inserted before this op: input {index}, "
                           f"{format_steps(placements, steps)} (dtorch.set_strict(True) makes every "
                           "redistribute explicit)")
            failure = failure or error
    return moved, failure
