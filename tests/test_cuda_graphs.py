"""CUDA graphs for fused runs on a GPU (runtime/worker/cuda_graphs.py, issue 46).

Without a GPU, torch.cuda's graph and streams are stood in for on CPU tensors: the stand-in
graph records the aten calls made during a capture (a TorchDispatchMode) and leaves their
results as garbage (NaN), as a capture runs no kernel; a replay reruns them into the same
tensors, as CUDA reruns kernels into the same addresses. So a GraphedRun that forgot to copy
its inputs in, to replay after capturing, or to clone its outputs out gives wrong values here.
The tests marked `cuda` run the same checks on a real GPU and skip without one, saying so
(scripts/gpu_check.py runs this file on the GPU machine).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dtorch
from dtorch.runtime.worker import cuda_graphs, fusion
from dtorch.runtime.worker.cuda_graphs import GraphedRun
from dtorch.spec.placements import Replicate

pytestmark = pytest.mark.timeout(300)

NO_GPU = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
SYNC = torch.ops.aten._local_scalar_dense.default   # a host sync (.item(), float(tensor))
NOT_CAPTURABLE = torch.ops.aten.cumsum.default     # stands for an op CUDA refuses to capture


# --- stand-ins for torch.cuda's graph and streams ---------------------------------------------------
class _Tape(TorchDispatchMode):
    """The aten calls of a capture, each with the tensors it wrote; `replay` reruns them. A host
    sync or a NOT_CAPTURABLE op invalidates the capture, as CUDA does."""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self.refused: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (SYNC, NOT_CAPTURABLE):
            self.refused = "operation not permitted when stream is capturing"
            raise RuntimeError(f"CUDA error: {self.refused}")
        result = func(*args, **kwargs)
        written = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor) and not _aliases(t, args)]
        self.calls.append((func, args, kwargs, written))
        for tensor in written:   # a capture runs no kernel: what it allocated holds garbage until a replay
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        return result

    def replay(self) -> None:
        for func, args, kwargs, written in self.calls:
            fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)
                     and not _aliases(t, args)]
            for into, value in zip(written, fresh):
                into.copy_(value)


class _SyncCheck(TorchDispatchMode):
    """torch.cuda's sync debug mode "error": a host sync raises what torch raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is SYNC:
            raise RuntimeError(cuda_graphs.HOST_SYNC)
        return func(*args, **(kwargs or {}))


def _aliases(tensor: torch.Tensor, args) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == pointer
               for a in tree_flatten(args)[0])


@pytest.fixture
def stand_ins(monkeypatch):
    """torch.cuda's CUDAGraph, Stream, stream and current_stream stood in for; graphs on "cpu".
    Yields the log of what happened on which stream, and the stack of current streams."""
    log, current = [], []

    class Stream:
        def __init__(self, device=None, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            log.append(("capture_begin", current[-1].name, capture_error_mode))
            self.tape = _Tape()
            self.tape.__enter__()

        def capture_end(self):
            self.tape.__exit__(None, None, None)
            log.append(("capture_end", current[-1].name))
            if self.tape.refused:   # as cudaStreamEndCapture on an invalidated capture
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        def replay(self):
            log.append(("replay", current[-1].name))
            self.tape.replay()

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    current.append(Stream(name="compute"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda_graphs, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cuda_graphs, "_SIDE_STREAMS", {})
    monkeypatch.setattr(cuda_graphs, "_host_syncs_refused", _SyncCheck)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))
    monkeypatch.setattr(cuda_graphs, "_end_failed_capture", lambda pool: log.append(("end_failed_capture", pool)))
    monkeypatch.delenv(cuda_graphs.SETTING, raising=False)
    return log, current


def _logged(function, log):
    """`function`, noting in `log` each time it runs and on which stream."""
    def run(*inputs):
        log.append(("run", torch.cuda.current_stream().name))
        return function(*inputs)
    return run


def _pair(x, y):
    return (x * 2 + y, (x - y).sum(0))


def _inputs(seed: int, rows: int = 5, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, 3, generator=g).to(device) for _ in range(2))


def _assert_pair(got: tuple, x, y) -> None:
    for got_one, want in zip(got, _pair(x, y), strict=True):
        torch.testing.assert_close(got_one, want, rtol=1e-6, atol=1e-6)


# --- the class, on CPU stand-ins ----------------------------------------------------------------------
def test_replays_copy_the_inputs_in_and_clone_the_outputs_out(stand_ins):
    log, _ = stand_ins
    run = GraphedRun(_logged(_pair, log), warm_up_calls=1)
    calls = [_inputs(seed) for seed in range(5)]
    results = [run(*inputs) for inputs in calls]
    assert run.graph is not None and run.uncaptured is None
    for got, (x, y) in zip(results, calls):   # a later replay left every earlier call's outputs alone
        _assert_pair(got, x, y)
    assert sum(entry[0] == "run" for entry in log) == 3   # the warm-up call, the side stream's, the capture
    assert sum(entry[0] == "replay" for entry in log) == 4
    pointers = {t.untyped_storage().data_ptr() for t in run.static_outputs}
    assert not pointers & {t.untyped_storage().data_ptr() for got in results for t in got}


def test_the_capture_waits_on_a_side_stream_and_replays_on_the_current_one(stand_ins):
    log, current = stand_ins
    run = GraphedRun(_logged(_pair, log), warm_up_calls=0)
    x, y = _inputs(1)
    _assert_pair(run(x, y), x, y)
    assert log == [("wait_stream", "side", "compute"), ("run", "side"), ("wait_stream", "compute", "side"),
                   ("capture_begin", "side", "thread_local"), ("run", "side"), ("capture_end", "side"),
                   ("replay", "compute")], log
    assert [s.name for s in current] == ["compute"]


def _syncs(x, y):   # float() reads the value on the host: no graph can hold that
    return _pair(x * float(y.abs().max()), y)


def _not_capturable(x, y):
    return _pair(x.cumsum(0), y)


@pytest.mark.parametrize("function, reference, reason", [
    (_syncs, _syncs, "the run reads a value on the host (RuntimeError: called a synchronizing CUDA operation)"),
    (_not_capturable, _not_capturable, "RuntimeError: CUDA error: operation not permitted when stream is capturing; "
                                       "then RuntimeError: CUDA error: operation failed due to a previous error"),
], ids=["host sync, found in the warm-up", "refused by the capture"])
def test_a_run_that_cannot_be_captured_runs_uncaptured_with_one_warning_naming_why(stand_ins, function, reference,
                                                                                   reason):
    log, current = stand_ins
    run = GraphedRun(function, warm_up_calls=1)
    calls = [_inputs(seed) for seed in range(4)]
    with pytest.warns(RuntimeWarning) as caught:
        results = [run(*inputs) for inputs in calls]
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert str(warning.message).startswith("dtorch.compile(backend='inductor'): a fused run on the GPU runs "
                                           "without a CUDA graph: " + reason), warning.message
    assert run.graph is None and run.uncaptured.startswith(reason)
    assert [s.name for s in current] == ["compute"]   # the stream is the caller's again
    refused_by_capture = function is _not_capturable
    assert sum(entry[0] == "capture_begin" for entry in log) == refused_by_capture
    assert (("end_failed_capture", (0, 7)) in log) == refused_by_capture   # the allocator set right
    for got, (x, y) in zip(results, calls):
        for got_one, want in zip(got, reference(x, y), strict=True):
            torch.testing.assert_close(got_one, want)


def test_inputs_of_another_shape_run_uncaptured_and_the_graph_stays(stand_ins):
    log, _ = stand_ins
    run = GraphedRun(_pair, warm_up_calls=0)
    run(*_inputs(0))
    graph = run.graph
    for rows in (7, 5, 1):   # (an uneven shard's block on another call cannot happen: shapes are per graph)
        x, y = _inputs(rows, rows)
        _assert_pair(run(x, y), x, y)
    assert run.graph is graph and sum(entry[0] == "replay" for entry in log) == 2


def test_a_failing_warm_up_is_the_function_s_error_not_a_capture_error(stand_ins):
    def picks(table, index):
        if index.numel() > 2:   # (a check on shapes: it reads no value on the host)
            raise RuntimeError("index out of range (simulated, RuntimeError as CUDA's are)")
        return (table.index_select(0, index) * 2,)
    run = GraphedRun(picks, warm_up_calls=0)
    table = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeError, match="index out of range"):
            run(table, torch.tensor([1, 0, 40]))   # the caller's error to report
        assert run.uncaptured is None and run.graph is None   # so the next call captures
        for index in (torch.tensor([3, 0]), torch.tensor([2, 2])):
            torch.testing.assert_close(run(table, index)[0], table[index] * 2)
    assert run.graph is not None


def test_a_parameter_read_under_no_grad_is_captured(stand_ins):
    weight = torch.nn.Parameter(torch.randn(3, 3))   # requires grad; an inference forward reads it
    run = GraphedRun(lambda x, w: (x @ w,), warm_up_calls=0)
    with torch.no_grad():
        results = [(x, run(x, weight)) for x, _ in map(_inputs, range(3))]
    assert run.graph is not None
    for x, (got,) in results:
        torch.testing.assert_close(got, x @ weight.detach())


@pytest.mark.parametrize("still_routing", [True, False])
def test_a_failed_capture_s_pool_is_ended_and_released_once(monkeypatch, still_routing):
    """CUDAGraph.capture_end raises before it ends the allocator's routing to the pool when the
    capture was invalidated; where it got past that, ending again raises and nothing is released."""
    calls = []

    def end(device, pool):
        calls.append(("end", device, pool))
        if not still_routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: calls.append(("release", device, pool)),
                        raising=False)
    cuda_graphs._end_failed_capture((0, 7))
    assert calls == [("end", 3, (0, 7))] + ([("release", 3, (0, 7))] if still_routing else [])


def test_what_is_never_captured(monkeypatch):
    x = torch.ones(2)
    assert cuda_graphs.uncapturable([x]) == "a tensor on cpu"
    assert cuda_graphs.graphed(_pair, (x, x), (x,)) is _pair
    monkeypatch.setattr(cuda_graphs, "DEVICE_TYPE", "cpu")
    assert cuda_graphs.uncapturable([x, x.clone()], [x]) is None
    parameter = torch.nn.Parameter(torch.ones(2))
    with torch.no_grad():   # a parameter read under no_grad: nothing recorded, so a graph holds it
        assert cuda_graphs.uncapturable([parameter], [parameter * 2]) is None
    assert "autograd records" in cuda_graphs.uncapturable([parameter], [parameter * 2])
    assert cuda_graphs.uncapturable([x, 3]) == "a int where a tensor was expected"
    assert isinstance(cuda_graphs.graphed(_pair, (x, x), (x,)), GraphedRun)
    monkeypatch.setenv(cuda_graphs.SETTING, "0")
    assert cuda_graphs.graphed(_pair, (x, x), (x,)) is _pair


# --- the hook in fusion.FusedRun: a worker in process, inductor stood in for -------------------------
def test_a_fused_run_on_the_gpu_replays_its_graph_from_the_second_call(stand_ins, monkeypatch):
    """test_compile_fusion's chain (index_select, matmul, sin, mul, tanh) on one worker, with
    torch.compile as the identity (inductor's C++ kernels would not pass the stand-in's tape)."""
    import test_compile_fusion as chain
    log, _ = stand_ins
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    monkeypatch.setattr(fusion, "_missing_compiler", lambda inputs: None)
    table = torch.randn(7, 5)
    worker, replies = chain._fused_worker(table)
    (run,) = chain._fused_runs(worker)
    indices = [torch.tensor([0, 6, 2]), torch.tensor([4, 4, 1]), torch.tensor([3, 3, 0]), torch.tensor([1, 5, 6])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for out_id, index in enumerate(indices, 10):
            chain._replay(worker, index, table.T.contiguous(), out_id)
    assert isinstance(run.compiled, GraphedRun) and run.compiled.graph is not None
    assert sum(entry[0] == "replay" for entry in log) == 3   # the first call compiled; then one replay each
    for out_id, index in enumerate(indices, 10):   # kept in the table across later replays, unchanged
        chain._close(worker.tensors[out_id], chain._chain_in_torch(table, index))
    assert replies.sent == []


def test_graphs_off_leave_the_fused_run_as_compiled(stand_ins, monkeypatch):
    import test_compile_fusion as chain
    monkeypatch.setenv(cuda_graphs.SETTING, "0")
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    monkeypatch.setattr(fusion, "_missing_compiler", lambda inputs: None)
    table = torch.randn(7, 5)
    worker, _ = chain._fused_worker(table)
    (run,) = chain._fused_runs(worker)
    for out_id in (10, 11):
        chain._replay(worker, torch.tensor([2, 1]), table.T.contiguous(), out_id)
    assert run.compiled is run.pure and stand_ins[0] == []


# --- on a real GPU --------------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_on_a_gpu_replays_equal_torch_and_keep_earlier_outputs(compiled):
    function = torch.compile(_pair, backend="inductor", dynamic=False, fullgraph=True) if compiled else _pair
    run = GraphedRun(function, warm_up_calls=1)
    stream = torch.cuda.Stream()   # the worker's compute stream is not the default one
    with torch.cuda.stream(stream):
        calls = [_inputs(seed, device="cuda") for seed in range(5)]
        results = [run(*inputs) for inputs in calls]
    torch.cuda.synchronize()
    assert run.graph is not None, run.uncaptured
    for got, (x, y) in zip(results, calls):
        _assert_pair(got, x, y)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_on_a_gpu_a_host_sync_is_found_before_the_capture_and_runs_uncaptured_with_one_warning():
    run = GraphedRun(_syncs, warm_up_calls=1)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        calls = [_inputs(seed, device="cuda") for seed in range(3)]
        with pytest.warns(RuntimeWarning, match="reads a value on the host") as caught:
            results = [run(*inputs) for inputs in calls]
        assert torch.cuda.current_stream() == stream   # the caller's stream again
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert torch.cuda.get_sync_debug_mode() == 0   # torch's setting is back
    torch.cuda.synchronize()
    assert run.graph is None and run.uncaptured
    for got, (x, y) in zip(results, calls):
        for got_one, want in zip(got, _syncs(x, y), strict=True):
            torch.testing.assert_close(got_one, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_on_a_gpu_a_fused_run_in_a_worker_replays_its_graph():
    """test_compile_fusion's chain on one worker in process, on a CudaDevice (shared-GPU mode: no
    cupy), compiled by inductor: the second replay captures, every output equals torch's."""
    import test_compile_fusion as chain
    from dtorch.runtime import protocol as wire
    from dtorch.runtime.devices.cuda import CudaDevice
    from dtorch.runtime.worker.worker import Worker
    from test_replay_rows import Replies, deliver
    replies = Replies()
    worker = Worker(0, replies, None, CudaDevice("cuda:0", share_gpu=True), start_seq=0)
    table = torch.randn(7, 5, device="cuda")
    deliver(worker, lambda s: [
        wire.DefineMesh(s, 0, "cuda", (1,), (0,)),
        wire.Factory(s + 1, chain.TABLE, 0, "zeros", tuple(table.shape), "float32", chain.REPLICATE, ()),
        wire.DefineGraph(s + 2, 7, chain._chain_rows(), (chain.CAPTURED, chain.CAPTURED + 6), (chain.CAPTURED + 5,),
                         tuple(chain.CAPTURED + i for i in range(1, 5)), (), (), (), "inductor")])
    worker.tensors[chain.TABLE] = table
    indices = [torch.tensor(i, device="cuda") for i in ([0, 6, 2], [4, 4, 1], [3, 3, 0], [1, 5, 6])]
    torch.cuda.synchronize()   # the worker computes on its own stream: what this one made is done
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for out_id, index in enumerate(indices, 10):
            chain._replay(worker, index, table.T.contiguous(), out_id)
            torch.cuda.synchronize()
    (run,) = chain._fused_runs(worker)
    assert isinstance(run.compiled, GraphedRun) and run.compiled.graph is not None, run.compiled
    for out_id, index in enumerate(indices, 10):
        chain._close(worker.tensors[out_id], chain._chain_in_torch(table, index))
    assert replies.sent == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_on_a_gpu_a_fused_chain_keeps_every_call_s_output(session):
    """dtorch.compile(backend="inductor") on a cuda (1,) mesh: replays from the third call are
    graph replays; every output, read after all calls, equals torch's."""
    from test_cuda import _cuda_mesh   # (imported here: it imports the CPU suite's checks)
    mesh = _cuda_mesh("cuda1")   # skips, saying why, without cupy
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 64, generator=g) / 8
    w = dtorch.tensor(weight, device_mesh=mesh, placements=[Replicate()])

    def chain(x, w):
        y = (x @ w).relu() * 1.5 + 0.25
        return (y.sin() + y.cos()).tanh() - x
    fused = dtorch.compile(chain, backend="inductor")
    inputs = [torch.randn(16, 64, generator=g) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # neither an unfused run nor an uncaptured one
        outputs = [fused(dtorch.tensor(x, device_mesh=mesh, placements=[Replicate()]), w) for x in inputs]
        got = [out.to_torch() for out in outputs]
    for value, x in zip(got, inputs):
        torch.testing.assert_close(value.cpu(), chain(x, weight), rtol=1e-5, atol=1e-5)
