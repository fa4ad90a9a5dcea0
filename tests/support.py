"""Helpers the tests share (kept out of conftest.py: tests/launcher has a conftest of its own,
and `from conftest import ...` would pick whichever was imported first)."""
from __future__ import annotations

import os
import subprocess
import sys
import itertools
import textwrap

import torch

import dtorch
from dtorch.spec.placements import DeviceMesh, Partial, Replicate, Shard
from dtorch.ops.tooling.simulate import contributions
from dtorch.ops.tensor_meta import tensor_meta
from dtorch.runtime import protocol
from dtorch.runtime.controller import session

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alive(pid: int) -> bool:
    """Running, not a zombie. The process may be reaped between the two checks: then its /proc
    entry is gone, which is an answer too."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")   # the name may hold spaces
    except (ProcessLookupError, FileNotFoundError):
        return False


def run_script(source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a fresh controller in its own process (for tests that kill things)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})


def assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    """Same shape and dtype; values bit-equal (exact, integers, bools) or within float tolerance.
    NaN must sit exactly where torch put it."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if exact or not expected.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def on_every_rank(mesh, kernel: str, width: int) -> torch.Tensor:
    """Run `kernel(device)`, a worker kernel that returns `width` int64 numbers about its own
    process (compile_counters: runtime/worker/compile_counters.py), on every rank of the 1-D
    `mesh`: a (ranks, width) tensor, rank by rank."""
    controller = session.controller()
    (out_id,) = controller.new_ids(1)
    seq = controller.submit(protocol.RunOp, (out_id,), controller.define_mesh(mesh), kernel, kernel, (),
                            {"device": mesh.device_type}, (), False)
    spec = tensor_meta((width * mesh.size(),), torch.int64, mesh, [Shard(0)])
    return dtorch.DTensor(out_id, spec, seq, controller).to_torch().view(mesh.size(), width)


class Symbol:
    """Stands in for a DTensor in pure rule tests: the rules only look at `_spec`."""
    def __init__(self, shape, placements, mesh=DeviceMesh("cpu", [0, 1, 2, 3]), dtype=torch.float32):
        self._meta = tensor_meta(shape, dtype, mesh, placements)


def placed(value, mesh, placements, g, split=None):
    """Upload `value` as `placements`; Partial dims of one kind get random contributions
    (simulate.split_partial's, or `split`'s)."""
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    kinds = {placements[m].reduce_op for m in partial_dims}
    if len(kinds) != 1:
        return dtorch.tensor(value, device_mesh=mesh, placements=placements)
    held = contributions(value, mesh, placements, g, split)
    grid = [mesh.shape[m] for m in partial_dims]
    pieces = []
    for index in itertools.product(*map(range, grid)):
        coordinate = [0] * mesh.ndim
        for m, i in zip(partial_dims, index):
            coordinate[m] = i
        pieces.append(held[tuple(coordinate)])
    stacked = torch.stack(pieces).reshape(*grid, *value.shape)
    k, layout = len(partial_dims), []
    for p in placements:
        layout.append(Shard(partial_dims.index(len(layout))) if isinstance(p, Partial) else
                      Shard(p.dim + k) if isinstance(p, Shard) else Replicate())
    spread = dtorch.tensor(stacked, device_mesh=mesh, placements=layout)
    dims = tuple(range(k))
    result = spread.sum(dims, dtype=value.dtype) if kinds == {"sum"} else spread.amax(dims)
    assert result.placements == tuple(placements), (result.placements, placements)
    return result
