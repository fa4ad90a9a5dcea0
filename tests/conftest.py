"""Shared fixtures: one pool of 4 real worker processes for the whole run, meshes over it, and a
check that nothing is left running afterwards."""
from __future__ import annotations

import os

import pytest

import dtorch
from dtorch.distributed_spec import init_device_mesh

from support import alive


@pytest.fixture(scope="session")
def session():
    dtorch.init(num_workers=4)
    pids = [w["pid"] for w in dtorch.workers()]
    yield
    dtorch.shutdown()
    for pid in pids:
        assert not alive(pid), f"worker pid {pid} still running after shutdown"


@pytest.fixture
def strict():
    """dtorch.set_strict(True) for one test: placements that do not line up raise PlacementError
    instead of getting redistributes inserted (for tests of the refusal and its message)."""
    before = dtorch.is_strict()
    dtorch.set_strict(True)
    yield
    dtorch.set_strict(before)


@pytest.fixture
def automatic():
    """dtorch.set_strict(False) for one test, whatever DTORCH_STRICT says."""
    before = dtorch.is_strict()
    dtorch.set_strict(False)
    yield
    dtorch.set_strict(before)


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


