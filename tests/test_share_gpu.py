"""Shared-GPU mode without a GPU (runtime/devices/shared_gpu.py, gpu_assignment.py): the setting,
which GPU each rank gets, the error without the setting, which communicator a worker makes, and
SharedGpuCommunicator's own code, run on CPU tensors by four members in threads of this process
and compared with plain torch. tests/test_cuda.py runs the mode on a GPU (DTORCH_SHARE_GPU=1).
"""
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import dtorch
from dtorch.errors import MeshError
from dtorch.runtime.devices import cuda, gpu_assignment
from dtorch.runtime.devices.shared_gpu import SharedGpuCommunicator
from support import assert_same


# --- the setting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("given,environment,expected", [
    (None, None, False), (None, "1", True), (None, "0", False), (True, "0", True), (False, "1", False)])
def test_the_keyword_wins_over_the_environment(monkeypatch, given, environment, expected):
    if environment is None:
        monkeypatch.delenv(gpu_assignment.ENV_SHARE_GPU, raising=False)
    else:
        monkeypatch.setenv(gpu_assignment.ENV_SHARE_GPU, environment)
    assert gpu_assignment.share_gpu_setting(given) is expected


def test_a_bad_setting_says_what_is_expected(monkeypatch):
    monkeypatch.setenv(gpu_assignment.ENV_SHARE_GPU, "yes")
    with pytest.raises(ValueError, match="DTORCH_SHARE_GPU='yes': expected 1"):
        gpu_assignment.share_gpu_setting(None)
    with pytest.raises(ValueError, match="share_gpu=1: expected True or False"):
        gpu_assignment.share_gpu_setting(1)


# --- which GPU, and the error without the setting ----------------------------------------------------
def test_shared_ranks_go_round_robin_over_the_gpus():
    assert gpu_assignment.shared_gpus(1, range(4, 8)) == [0, 0, 0, 0]
    assert gpu_assignment.shared_gpus(2, range(4, 8)) == [0, 1, 0, 1]
    assert gpu_assignment.shared_gpus(3, [7]) == [1]   # a replaced rank lands where it was


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_shared_session_assigns_more_workers_than_gpus(monkeypatch, gpus):
    monkeypatch.setattr(gpu_assignment, "visible_gpus", lambda: gpus)
    shared = SimpleNamespace(share_gpu=True, workers={})
    assert gpu_assignment.assign_devices("cuda", range(4), shared, None) == [f"cuda:{r % gpus}" for r in range(4)]


def test_without_the_setting_more_workers_than_gpus_names_it(monkeypatch):
    monkeypatch.setattr(gpu_assignment, "visible_gpus", lambda: 1)
    plain = SimpleNamespace(share_gpu=False, workers={})
    with pytest.raises(MeshError, match=r"sees 1 GPU.*share_gpu=True\) or DTORCH_SHARE_GPU=1"):
        gpu_assignment.assign_devices("cuda", range(4), plain, None)


def test_a_shared_session_still_needs_a_gpu(monkeypatch):
    def no_gpu():
        raise MeshError("no CUDA device visible to torch")
    monkeypatch.setattr(gpu_assignment, "visible_gpus", no_gpu)
    with pytest.raises(MeshError, match="no CUDA device"):
        gpu_assignment.check_available("cuda", 4, SimpleNamespace(share_gpu=True, workers={}))


# --- which communicator -----------------------------------------------------------------------------
@pytest.mark.parametrize("device,shared,expected", [
    ("cpu", False, "gloo"), ("cpu", True, "gloo"), ("cuda:0", False, "nccl"), ("cuda:0", True, "gloo-shared-gpu")])
def test_communicator_names(device, shared, expected):
    assert gpu_assignment.communicator_name(device, shared) == expected


@pytest.mark.parametrize("shared,expected", [(False, "NcclCommunicator"), (True, "SharedGpuCommunicator")])
def test_a_cuda_device_makes_the_communicator_of_its_mode(monkeypatch, shared, expected):
    """The one thing the mode changes on a worker: CudaDevice.communicator (no GPU: both classes
    are stood in for, the device is made without touching CUDA)."""
    for name in ("NcclCommunicator", "SharedGpuCommunicator"):
        monkeypatch.setattr(cuda, name, lambda *args, _name=name, **kwargs: _name)
    device = cuda.CudaDevice.__new__(cuda.CudaDevice)
    device.share_gpu = shared
    assert device.communicator("127.0.0.1:1", 0, "127.0.0.1", 1.0) == expected


def test_workers_say_which_communicator_they_use(session):
    assert {w["communicator"] for w in dtorch.workers() if w["device"] == "cpu"} == {"gloo"}


def test_a_running_session_keeps_its_sharing(session):
    from dtorch.runtime.controller import session as sessions
    running = sessions.controller().share_gpu   # False, unless this run has DTORCH_SHARE_GPU=1
    with pytest.raises(ValueError, match=f"runs with share_gpu={running}, set when it started"):
        dtorch.init(share_gpu=not running)
    assert dtorch.init(share_gpu=running) is sessions.controller()


# --- SharedGpuCommunicator's code, on CPU tensors ----------------------------------------------------
MEMBERS = (0, 1, 2, 3)


def run_members(work, members=MEMBERS, timeout_s: float = 60.0) -> list:
    """work(communicator, rank) on one SharedGpuCommunicator per member, each in a thread; the results
    in member order. Every communicator is closed; a member that does not finish fails the test."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    results, errors = {}, []

    def member(rank):
        communicator = SharedGpuCommunicator(address, rank, "127.0.0.1", timeout_s)
        try:
            results[rank] = work(communicator, rank)
        except BaseException as error:  # noqa: BLE001 -- reported below, on the test's thread
            errors.append(error)
        finally:
            communicator.close()
    threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a member never finished"
    if errors:
        raise errors[0]
    return [results[rank] for rank in members]


def member_value(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.Size(shape).numel())).reshape(shape) * (rank + 1) % 11).to(dtype)


@pytest.mark.parametrize("shape", [(4, 6), (3, 5)])
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
def test_all_reduce_matches_torch_in_place(shape, reduce_op):
    def work(communicator, rank):
        tensor = member_value(rank, shape)
        result = communicator.all_reduce(MEMBERS, tensor, reduce_op)
        assert result is tensor   # in place, as NCCL's
        return result
    stacked = torch.stack([member_value(r, shape) for r in MEMBERS])
    expected = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}
    for result in run_members(work):
        assert_same(result, expected[reduce_op])


def test_gathers_scatters_and_exchanges_match_torch():
    """all_gather, reduce_scatter, all_to_all and exchange in one run (uneven shapes, integers)."""
    pieces = (3, 5)

    def work(communicator, rank):
        mine = member_value(rank, pieces, torch.int64)
        stacked = torch.stack([mine + peer for peer in range(len(MEMBERS))])
        receive = torch.empty(pieces, dtype=torch.int64)
        right, left = MEMBERS[(rank + 1) % 4], MEMBERS[(rank - 1) % 4]
        communicator.exchange(MEMBERS, [(right, mine)], [(left, receive)])
        return (communicator.all_gather(MEMBERS, mine), communicator.reduce_scatter(MEMBERS, stacked, "sum"),
                communicator.all_to_all(MEMBERS, stacked), receive,
                communicator.agree_max(MEMBERS, rank * 10))
    values = [member_value(r, pieces, torch.int64) for r in MEMBERS]
    for rank, (gathered, scattered, exchanged, received, agreed) in enumerate(run_members(work)):
        assert_same(gathered, torch.stack(values), exact=True)
        assert_same(scattered, sum(v + rank for v in values), exact=True)
        assert_same(exchanged, torch.stack([v + rank for v in values]), exact=True)
        assert_same(received, values[(rank - 1) % 4], exact=True)
        assert agreed == 30


def test_it_behaves_as_nccl_where_callers_can_tell():
    """Background reductions in one order after the rest (background_collectives False), and a
    host communicator of its own object, which the worker closes and regroups separately."""
    assert SharedGpuCommunicator.background_collectives is False

    def work(communicator, rank):
        communicator.prepare_background(MEMBERS[:2])
        finish = communicator.start_all_reduce(MEMBERS[:2], torch.full((5,), float(rank)), "sum")
        return finish(), communicator.host is not communicator
    for result, separate_host in run_members(work, members=MEMBERS[:2]):
        assert_same(result, torch.full((5,), 1.0))
        assert separate_host


def test_a_one_rank_group_moves_nothing_and_matches_torch():
    """As NCCL skips it: no Gloo group is made, results are the reference's."""
    value = member_value(0, (3, 4))

    def work(communicator, rank):
        alone = (rank,)
        results = (communicator.all_reduce(alone, value.clone(), "avg"), communicator.all_gather(alone, value),
                   communicator.reduce_scatter(alone, value.unsqueeze(0), "sum"),
                   communicator.all_to_all(alone, value.unsqueeze(0)))
        communicator.exchange(alone, [], [])
        return results, dict(communicator.host._groups)
    (results, groups), = run_members(work, members=(0,))
    reduced, gathered, scattered, exchanged = results
    assert groups == {}
    assert_same(reduced, value, exact=True)
    assert_same(gathered, value.unsqueeze(0), exact=True)
    assert_same(scattered, value, exact=True)
    assert_same(exchanged, value.unsqueeze(0), exact=True)


def test_it_has_the_communicator_interface():
    import inspect
    from dtorch.runtime.devices.comm import Communicator
    for name, member in vars(Communicator).items():
        if name.startswith("_") or isinstance(member, property):
            continue
        assert inspect.signature(getattr(SharedGpuCommunicator, name)) == inspect.signature(member), name


# --- the worker's whole use of it: CPU workers take it for a run (device.STAGED_ON_CPU_VARIABLE) ----------
STAGED_SUITE = [   # redistributes over 2 communicators, the bucket path (dp2, fsdp2), the grouped gather
    "tests/test_redistribute.py::test_every_pair_on_a_2d_mesh[shape1]",
    "tests/test_redistribute.py::test_partial_reductions[max]",
    "tests/test_training.py::test_adamw_training_equals_single_process_torch[dp2]",
    "tests/test_training.py::test_adamw_training_equals_single_process_torch[fsdp2]",
    "tests/test_fsdp.py::test_a_module_gathers_its_parameters_with_one_command",
]


def test_the_cpu_suite_passes_with_workers_on_the_staged_communicator():
    """The CPU suite's own checks, against torch, with every worker's collectives staged as in
    shared-GPU mode: in a pytest of its own, since the variable applies as workers start."""
    import os
    import subprocess
    import sys
    from dtorch.runtime.devices.device import STAGED_ON_CPU_VARIABLE
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=240",
                             *STAGED_SUITE], cwd=root, env={**os.environ, STAGED_ON_CPU_VARIABLE: "1"},
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"{len(STAGED_SUITE)} passed" in result.stdout
