"""Shared fixtures: one pool of 4 real worker processes for the whole run, meshes over it, and a
check that nothing is left running afterwards."""
from __future__ import annotations

import sys

import pytest

import dtorch
from dtorch.spec.placements import init_device_mesh

from support import alive
import session_health


SHARED_WORKERS = 4
FAILURES_PRINTED_AS_THEY_HAPPEN = 5
_shared_pids: list = []   # every worker the shared session started, restarts included
_failures_printed: list = []
_to_print: list = []   # printed once pytest's capture is off (in pytest_runtest_logreport)


def _start_shared_session() -> None:
    dtorch.init(num_workers=SHARED_WORKERS)
    _shared_pids.extend(w["pid"] for w in dtorch.workers())


@pytest.fixture(scope="session")
def session():
    _start_shared_session()
    yield
    dtorch.shutdown()
    for pid in _shared_pids:
        assert not alive(pid), f"worker pid {pid} still running after shutdown"


@pytest.fixture(autouse=True)
def _shared_session_survives_a_failure(request):
    """After a failed test that used the shared session: if that session no longer works (a
    lost worker, a retired mesh, a read that never completes), say why and start it again, so
    that one failure stays one failure instead of failing (and slowing) every test after it."""
    yield
    report = getattr(request.node, "dtorch_call_report", None)
    if report is None or not report.failed or "session" not in request.fixturenames:
        return
    problem = session_health.problem(SHARED_WORKERS)
    if problem is None:
        return
    _to_print.append(f"=== the shared session is broken after {request.node.nodeid}: {problem}\n"
                     f"{session_health.describe()}\n=== restarted it")
    dtorch.shutdown()
    _start_shared_session()


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.dtorch_call_report = report   # for _shared_session_survives_a_failure


def pytest_runtest_logreport(report):
    """Print the first few failures when they happen, with the shared session's state, not only
    in the summary at the end: a CI run killed at its time limit then still shows what failed
    first and why."""
    while _to_print:
        print("\n" + _to_print.pop(0), file=sys.__stderr__, flush=True)
    if not report.failed or len(_failures_printed) >= FAILURES_PRINTED_AS_THEY_HAPPEN:
        return
    _failures_printed.append(report.nodeid)
    print(f"\n=== failure #{len(_failures_printed)} as it happened: {report.nodeid} ({report.when})\n"
          f"{report.longreprtext}\n{session_health.describe()}\n", file=sys.__stderr__, flush=True)
