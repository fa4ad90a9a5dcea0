"""A worker's side of activation checkpointing (dtorch.utils.checkpoint): the commands between a
CheckpointBegin and its CheckpointEnd run without recording for backward, so none of their
intermediates is saved; backward runs them again.

Why one autograd node per region, recomputed inside its own backward (torch's reentrant
checkpoint), rather than torch's saved-tensor hooks (its non-reentrant one): the hooks recompute
when the first saved tensor of the region is unpacked, and which node unpacks first can differ
between ranks (an empty shard saves nothing). A region with collectives would then run them at
different points of the backward on different ranks, and the group would wait forever. A single
node sits at the same place of every rank's graph (the anchor keeps it there), so every rank
recomputes at the same moment, with the same collectives in the same order.

Its inputs are the region's inputs from before it that require grad (activations and
parameters, fsdp shards included), and its backward returns their gradients through
torch.autograd.grad over the recomputed region: the outer engine accumulates them, so a
parameter used in and out of the region, or in two regions, is accumulated once, as always,
and `dtorch.autograd.grad` works through a region too.

RegionCommands is a component of the Worker (worker.py), which owns one: it takes the rank's
LocalShards (shards.py) and the worker as a RegionRunner, through which it takes every command
while a region is open (`divert`) and runs the region's commands, then and in the recompute.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .. import protocol as wire
from .backward import mark_used_in_region
from .kernels import _ANCHOR
from .op_arguments import input_ids
from .shards import LocalShards

__all__ = ["RegionCommands", "Region", "RegionRunner"]

RECOMPUTED, KEPT = wire.RECOMPUTED_IN_CHECKPOINT, wire.KEPT_IN_CHECKPOINT


class Region:
    """What one open region has run on this rank."""

    def __init__(self):
        self.commands: list = []    # RECOMPUTED commands, as sent (with their grad flags)
        self.made: set = set()      # ids they made
        self.recorded: set = set()  # ... those of commands that record for backward (grad=True)
        self.used: set = set()      # ... those a later command of the region reads
        self.read: dict = {}        # id -> tensor, each id read from before the region, as it was then
        self.depth = 1              # nested regions are part of the outermost
        self.refused: str | None = None   # a command a region cannot hold, named at its end

    def note(self, command, input_ids, tensors: dict) -> None:
        for tensor_id in input_ids:
            if tensor_id in self.made:
                self.used.add(tensor_id)
            elif tensor_id not in self.read and tensor_id in tensors:
                self.read[tensor_id] = tensors[tensor_id]
        self.commands.append(command)
        out_ids = _outputs(command)
        self.made.update(out_ids)
        if command.grad:
            self.recorded.update(out_ids)

    def note_leaves(self, ids, tensors: dict) -> None:
        """RequireGrad on tensors the region made (a parameter changed in place under no_grad
        gets its new id made a leaf): from here on they are leaves the region reads, kept as they
        are; the recompute puts them back over what it makes under their ids."""
        for tensor_id in ids:
            if tensor_id in self.made and tensor_id in tensors:
                self.made.discard(tensor_id)
                self.recorded.discard(tensor_id)
                self.read[tensor_id] = tensors[tensor_id]


def _outputs(command) -> tuple:
    return command.out_ids if type(command) is wire.RunOp else (command.out_id,)


def forward_only(command):
    """The command as it runs inside a region: nothing recorded for backward, and no source
    reduced in place (backward reads the region's inputs again)."""
    if type(command) is wire.RunOp:
        return command._replace(grad=False) if command.grad else command
    return command._replace(grad=False, donate=False)


class RegionRunner(Protocol):
    """What a region needs of the worker running it (worker.Worker)."""

    def divert(self, run: Callable[[object], None] | None) -> None:
        """From now on the loop passes each command to `run` instead of running it; None: runs
        them itself again."""

    def execute_or_record(self, command) -> None:
        """Run one command as the loop does (recorded while dtorch.profile is on): a failure
        poisons its outputs and is reported."""

    def failed(self, command, error: Exception) -> None:
        """The command raised `error`: poison its outputs, report it under its seq."""

    def handle(self, command) -> None:
        """Run one command's handler, and nothing around it: what it raises, raises."""


class RegionCommands:
    def __init__(self, shards: LocalShards, runner: RegionRunner):
        self.shards, self.runner = shards, runner
        self.region: Region | None = None   # the open region, while there is one

    def handle_checkpoint_begin(self, command: wire.CheckpointBegin) -> None:
        if self.region is not None:
            self.region.depth += 1
        else:
            self.region = Region()
            self.runner.divert(self.run_in_region)

    def handle_checkpoint_end(self, command: wire.CheckpointEnd) -> None:
        region = self.region
        if region is None:
            raise RuntimeError("a checkpoint region ended that never began")
        region.depth -= 1
        if region.depth:
            return
        self.region = None
        self.runner.divert(None)
        if region.refused is not None:
            raise RuntimeError(_refusal(region.refused) + "; the region's outputs have no gradient")
        self._connect_region(region)

    def run_in_region(self, command) -> None:
        """What the loop does with a command while a region is open (RegionRunner.divert)."""
        region, runner, tensors = self.region, self.runner, self.shards.tensors
        if type(command) in RECOMPUTED:
            region.note(command, input_ids(command), tensors)
            runner.execute_or_record(forward_only(command))
            return
        if type(command) in KEPT:
            runner.execute_or_record(command)
            if type(command) is wire.RequireGrad and command.flag:
                region.note_leaves(command.ids, tensors)
            return
        if region.refused is None:
            region.refused = f"{type(command).__name__} (command #{command.seq})"
        runner.failed(command, RuntimeError(_refusal(type(command).__name__)))

    def _connect_region(self, region: Region) -> None:
        """The region's tensors still held here that its commands recorded for backward become
        the outputs of one autograd node: the controller's verdict, the same on every rank, so
        each rank's graph gets the node whatever its own shards require. What the region made
        without recording (a buffer updated under no_grad) stays a plain tensor, as outside."""
        tensors = self.shards.tensors
        outputs = {i: tensors[i] for i in sorted(region.recorded) if i in tensors}
        if not outputs:
            return
        learned = {i: t for i, t in region.read.items() if t.requires_grad}
        with torch.enable_grad():   # (workers run with grad off but for what records)
            connected = RecomputedRegion.apply(self, region, tuple(outputs), tuple(outputs.values()), tuple(learned),
                                               _ANCHOR, *learned.values())
        for tensor_id, tensor in zip(outputs, connected):
            if tensor_id in region.used:   # its own gradient would need the region's inside: refused
                mark_used_in_region(tensor)
            tensors[tensor_id] = tensor

    def recompute(self, region: Region, leaves: dict) -> dict:
        """Run the region's commands again on `leaves` (id -> tensor) standing for what it read,
        each recording for backward as its grad flag says (the handlers switch grad on for those;
        the rest, run under no_grad by the user, stay out of the gradient); returns the table they
        filled. A failure raises: it fails the backward."""
        shards = self.shards
        table = shards.tensors
        with shards.set_aside():   # the tables hold the leaves and what the region makes, alone
            table.update(leaves)
            with torch.no_grad():   # (a backward's own mode, unless create_graph: said for clarity)
                for command in region.commands:
                    self.runner.handle(command)
                    for tensor_id in _outputs(command):   # a leaf made in the region stays that leaf
                        if tensor_id in leaves:
                            table[tensor_id] = leaves[tensor_id]
            for tensor_id, done in shards.in_flight.items():   # the backward reads them next
                shards.device.wait(done, table[tensor_id])
            return dict(table)


def _refusal(what: str) -> str:
    return (f"{what} cannot run inside dtorch.utils.checkpoint: the checkpointed function runs again in backward, "
            "and only its ops and redistributes can (not a backward, an optimizer step, a move to another mesh or a "
            "compiled function's replay); call it outside the checkpointed function")


class RecomputedRegion(torch.autograd.Function):
    """Outputs: the region's outputs as computed in the forward. Inputs: the anchor, then what
    the region read that requires grad. Backward: the region again, from detached copies of
    everything it read, and torch.autograd.grad from its outputs to those copies."""

    @staticmethod
    def forward(ctx, regions, region, output_ids, outputs, learned_ids, anchor, *learned):
        ctx.regions, ctx.region, ctx.output_ids, ctx.learned_ids = regions, region, output_ids, learned_ids
        connected = tuple([t.detach() for t in outputs])
        ctx.mark_non_differentiable(*[t for t in connected if not (t.is_floating_point() or t.is_complex())])
        return connected

    @staticmethod
    def backward(ctx, *grads):
        region = ctx.region
        leaves = {i: t.detach().requires_grad_(t.requires_grad) for i, t in region.read.items()}
        table = ctx.regions.recompute(region, leaves)
        pairs = [(table[i], g) for i, g in zip(ctx.output_ids, grads)
                 if g is not None and table[i].requires_grad]
        learned = [leaves[i] for i in ctx.learned_ids]
        found = (torch.autograd.grad([o for o, _ in pairs], learned, [g for _, g in pairs], allow_unused=True)
                 if pairs and learned else [None] * len(learned))
        return (None,) * 6 + tuple(found)
