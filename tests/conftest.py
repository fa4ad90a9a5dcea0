"""Shared fixtures: one pool of 4 real worker processes for the whole run, meshes over it, and a
check that nothing is left running afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dtorch
from dtorch.distributed_spec import init_device_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def session():
    dtorch.init(num_workers=4)
    pids = [w["pid"] for w in dtorch.workers()]
    yield
    dtorch.shutdown()
    for pid in pids:
        assert not _alive(pid), f"worker pid {pid} still running after shutdown"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="session")
def mesh1(session):
    return init_device_mesh("cpu", (1,), mesh_dim_names=["dp"])


@pytest.fixture(scope="session")
def mesh4(session):
    return init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])


@pytest.fixture(scope="session")
def mesh22(session):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


@pytest.fixture(params=["mesh1", "mesh4", "mesh22"])
def mesh(request):
    return request.getfixturevalue(request.param)


def run_script(source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a fresh controller in its own process (for tests that kill things)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if exact or not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected), (actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
