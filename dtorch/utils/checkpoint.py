"""Activation checkpointing: `checkpoint(fn, *args)` runs fn without keeping its intermediates
for backward, and backward runs it again, as torch.utils.checkpoint does.

    out = dtorch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=False)
    out = torch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=False)   # the same, on DTensors

The controller marks the commands fn issues with a CheckpointBegin and a CheckpointEnd. The
workers run them without recording, keep only the tensors the region read from before it, and
make what it returns the outputs of one autograd node whose backward runs the region's commands
again (runtime/worker/checkpoint_regions.py says why it is one node). Backward then costs the region's
forward once more, collectives included (an fsdp layer gathers its parameters again, as FSDP
with activation checkpointing does), and nothing the controller does per op changes.

Random ops draw the same numbers when run again: dtorch's are functions of the call's seed and
counter, carried in the command (preserve_rng_state is always in effect). `use_reentrant` is
accepted and has no effect: both of torch's forms give these gradients, and
`dtorch.autograd.grad` works through a region. What a region cannot hold raises at its own line,
before anything runs: a move to another mesh (a pipeline stage), a backward, an optimizer step, a
compiled function's call. A region belongs to the session, not to a thread: ops another thread
issues meanwhile join it.
"""
from __future__ import annotations

import functools

import torch.utils.checkpoint as torch_checkpoint

from ..nn.module import Module
from ..dtensor.recording import is_grad_enabled
from ..runtime import protocol as wire
from ..runtime.controller import session
from ..dtensor import frontend_state
from ..dtensor.tensor import DTensor

__all__ = ["checkpoint"]


def checkpoint(function, *args, use_reentrant: bool | None = None, context_fn=None, determinism_check: str = "default",
               debug: bool = False, preserve_rng_state: bool = True, **kwargs):
    """function(*args, **kwargs), its intermediates recomputed in backward instead of kept."""
    if context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn:
        raise NotImplementedError("checkpoint(context_fn=...) (selective activation checkpointing) is not supported "
                                  "on DTensors: every op of the region is recomputed; leave context_fn out")
    if not is_grad_enabled():   # nothing records: nothing to save or recompute
        return function(*args, **kwargs)
    controller = session.controller()
    controller.submit(wire.CheckpointBegin)
    state = frontend_state.of(controller)
    state.checkpoint_depth += 1   # refuse_inside_checkpoint refuses what a region cannot hold, at its line
    try:
        return function(*args, **kwargs)
    finally:
        state.checkpoint_depth -= 1
        # fn's own temporaries, dropped as it returned, are freed before the end: the workers
        # connect only what is still held (its outputs, and anything it stored away)
        controller.free_before_next()
        controller.submit(wire.CheckpointEnd)


def _holds_dtensors(function, args, kwargs) -> bool:
    if isinstance(getattr(function, "__self__", function), Module):   # a dtorch module or its bound forward
        return True
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, DTensor) or (type(v) in (list, tuple) and any(isinstance(x, DTensor) for x in v))
               for v in values)


def _install_torch_spelling() -> None:
    """torch.utils.checkpoint.checkpoint hands a call on DTensors (or a dtorch module) to ours:
    torch's own saves nothing of dtorch's ops and recomputes none of them, silently."""
    theirs = torch_checkpoint.checkpoint
    if getattr(theirs, "__wrapped_by_dtorch__", False):
        return

    @functools.wraps(theirs)
    def either(function, *args, **kwargs):
        if _holds_dtensors(function, args, kwargs):
            return checkpoint(function, *args, **kwargs)
        return theirs(function, *args, **kwargs)
    either.__wrapped_by_dtorch__ = True
    torch_checkpoint.checkpoint = either


_install_torch_spelling()
