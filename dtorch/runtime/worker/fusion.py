"""dtorch.compile(fn, backend="inductor"): each run of plain rows (straight_line.py) compiled by
torch's inductor on the worker, so a run of local ops is one fused kernel instead of one torch
call per op (docs/design/compile.md, "Fusing on the workers").

A FusedRun stands where its StraightLine stood in a graph's plan and answers the same `run`. It
hands the run's pure form (`fused(t3, t7) -> (t9, t12)`) to `torch.compile(backend="inductor",
dynamic=False, fullgraph=True)`; the first replay compiles it (a graph's shapes are fixed, so
once), through inductor's on-disk cache, which every rank of a host shares.

Anything that goes wrong in the fused function runs the StraightLine from the same inputs, which
are untouched (workers never write a buffer in place: docs/reference/inplace.md):
- if the rows succeed, inductor is at fault: the run keeps the StraightLine from then on, and
  the worker warns once with the reason (a RuntimeWarning that the controller shows at the
  user's line, as it shows any warning a command raised: WarningReport);
- if a row fails, the StraightLine reports it as a replay does (the op, its seq, the user's
  line). A run whose compiled function had worked before keeps it (a bad index this call);
  one that never compiled keeps the StraightLine.

Runs that are not fused, and why: a run with rows recorded for backward (a training forward:
their autograd recording, fsdp's saved-tensor hooks and the joins of backward.run_recorded are
not traced yet), and a run on CPU where no C++ compiler is found (inductor's CPU code is C++).
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch

from .straight_line import StraightLine

__all__ = ["FusedRun", "fuse"]


def fuse(plan: tuple | None) -> tuple | None:
    """The plan with each fusable StraightLine as a FusedRun."""
    if plan is None:
        return None
    return tuple([FusedRun(step) if type(step) is StraightLine and step.pure is not None else step for step in plan])


class FusedRun:
    """A StraightLine's rows as one inductor-compiled function (see the module's doc)."""

    def __init__(self, straight: StraightLine):
        self.straight, self.rows = straight, straight.rows
        self.compiled = torch.compile(straight.pure, backend="inductor", dynamic=False, fullgraph=True)
        self.replay_only = False   # set once the fused function failed: the StraightLine runs
        self.compiling = True      # until the first call, which compiles, has succeeded

    def forget(self) -> None:
        self.straight.forget()

    def run(self, tensors: dict):
        """As StraightLine.run: None when every row ran, else (row, error, what the rows made)."""
        if self.replay_only:
            return self.straight.run(tensors)
        try:
            inputs = [tensors[i] for i in self.straight.loads]
        except KeyError:   # missing or poisoned: the StraightLine says which
            return self.straight.run(tensors)
        try:
            outputs = self._compile_and_run(inputs) if self.compiling else self.compiled(*inputs)
        except _NoCompiler as missing:
            return self._fall_back(tensors, str(missing))
        except Exception as error:  # noqa: BLE001 -- inductor's or a row's: the StraightLine tells which
            return self._fall_back(tensors, f"{type(error).__name__}: {_first_line(error)}")
        tensors.update(zip(self.straight.stores, outputs))
        return None

    def _compile_and_run(self, inputs: list):
        """The first call, which compiles; until it succeeds, every call is a first call."""
        missing = _missing_compiler(inputs)
        if missing is not None:
            raise _NoCompiler(missing)
        with warnings.catch_warnings():   # torch's own deprecations while it compiles are not the user's business
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            outputs = self.compiled(*inputs)
        self.compiling = False
        return outputs

    def _fall_back(self, tensors: dict, reason: str):
        """Run the rows instead. A compiled function whose rows failed too (a bad index, which
        its bounds check caught) stays: the next inputs may be good."""
        self.replay_only = self.compiling
        stopped = self.straight.run(tensors)
        self.replay_only |= stopped is None
        if stopped is None:   # the rows ran: the fault was the compiler's
            first, last = self.rows.start, self.rows.stop - 1
            warnings.warn(f"dtorch.compile(backend='inductor'): rows {first}-{last} of this graph run as the replay, "
                          f"unfused: {reason}", RuntimeWarning, stacklevel=2)
        return stopped


class _NoCompiler(Exception):
    """No C++ compiler for a CPU run: the rows replay, and the user learns why."""


def _missing_compiler(inputs: list) -> str | None:
    """Why inductor cannot compile for these tensors' device here, or None."""
    if not any(type(t) is torch.Tensor and t.device.type == "cpu" for t in inputs):
        return None
    # imported here, before the run's first compile (it reads CXX once): importing inductor is
    # for workers whose graphs fuse, and it probes optional packages that dtorch does not declare
    from torch._inductor import config as inductor_config
    compiler = os.environ.get("CXX") or inductor_config.cpp.cxx[1] or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX), which inductor needs on CPU"
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
