"""CUDA graphs for a fused run on a GPU (docs/design/compile.md, "CUDA graphs").

A fused run's compiled function (fusion.FusedRun.compiled) is pure, `f(*inputs) -> tuple of
tensors`, and a graph's shapes are fixed by its signature, so on a GPU its kernels can be
captured once into a torch.cuda.CUDAGraph and each later call replayed with one launch. A
GraphedRun does that, keeping three rules that make it equal the uncaptured call:

- Inputs are copied into static buffers before each replay: the graph reads the addresses it
  was captured with, not the caller's tensors.
- Outputs are cloned out of the graph's static outputs: the worker's id table keeps a run's
  outputs across replays, and the next replay rewrites the static outputs in place.
- A run that cannot be captured runs uncaptured for good, with one RuntimeWarning naming the
  reason: a host sync (`.item()`, a shape that depends on the data), found in the warm-up call,
  which runs with torch's sync debug mode set to "error", or anything CUDA refuses to capture.
  A call whose inputs differ in shape or dtype from the captured ones runs uncaptured too.

What is never captured: tensors off the GPU or on two devices, outputs recorded by autograd (a
training forward: autograd and graphs need torch's cudagraph trees), and anything when
DTORCH_CUDA_GRAPHS=0. An input may require grad: a parameter read under no_grad.

Streams: a call runs on the current stream (the worker's compute stream). The capture's warm-up
call and the capture itself run on a side stream, which first waits for the current one; the
current stream waits for the warm-up before the first replay. Replays, the copies in and the
clones out run on the current stream, so they are ordered with the worker's other commands as
any kernel is. The capture mode is "thread_local": the worker's NCCL watchdog thread queries
events while a capture may be under way, and "global" forbids other threads such calls then.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

__all__ = ["GraphedRun", "graphed", "uncapturable", "enabled", "SETTING"]

SETTING = "DTORCH_CUDA_GRAPHS"   # "0": fused runs on a GPU are not captured
# The device type a graph is captured on. Only tests change it (to "cpu", with torch.cuda's
# graphs and streams stood in for), to check the copies and the replay order without a GPU.
DEVICE_TYPE = "cuda"
# device -> the side stream its captures run on. One per device, made once: torch hands out
# streams from a pool round-robin, so making one per capture would, after enough captures, hand
# out the worker's compute or communication stream.
_SIDE_STREAMS: dict = {}
HOST_SYNC = "called a synchronizing CUDA operation"   # what torch raises at one in sync debug mode "error"


def enabled() -> bool:
    """Whether fused runs on a GPU are captured (DTORCH_CUDA_GRAPHS, read when a run first compiles)."""
    return os.environ.get(SETTING, "1").strip() != "0"


def graphed(function, inputs, outputs):
    """`function` as a GraphedRun when its call with `inputs` gave `outputs` on one GPU without
    autograd, and graphs are on; else `function` itself. Its first call captures: `function` has
    run once already (inductor compiled on that call)."""
    if not enabled() or uncapturable(inputs, outputs) is not None:
        return function
    return GraphedRun(function, warm_up_calls=0)


def uncapturable(inputs, outputs=()) -> str | None:
    """Why a graph cannot hold a call with these inputs and outputs, or None when it can. An input
    may require grad (a parameter read under no_grad); an output that requires grad was recorded
    by autograd, which a replay would not do."""
    devices = set()
    for value in (*inputs, *outputs):
        if not isinstance(value, torch.Tensor):
            return f"a {type(value).__name__} where a tensor was expected"
        if value.device.type != DEVICE_TYPE:
            return f"a tensor on {value.device}"
        devices.add(value.device)
    if any(output.requires_grad for output in outputs):
        return "autograd records its outputs (training runs are not captured)"
    return None if len(devices) == 1 else f"tensors on {len(devices)} devices"


class GraphedRun:
    """`function`, a pure `f(*inputs) -> tuple of tensors` of fixed shapes, captured into a CUDA
    graph after `warm_up_calls` uncaptured calls and replayed from then on (the module's doc)."""

    def __init__(self, function, warm_up_calls: int = 1):
        self.function, self.warm_up_calls = function, warm_up_calls
        self.graph = None
        self.static_inputs: tuple = ()
        self.static_outputs: tuple = ()
        self.uncaptured: str | None = None   # why it runs uncaptured for good, once that is decided

    def __call__(self, *inputs):
        if self.graph is not None and self._fits(inputs):
            return self._replay(inputs)
        if self.graph is not None or self.uncaptured is not None:
            return self.function(*inputs)
        if self.warm_up_calls > 0:
            self.warm_up_calls -= 1
            return self.function(*inputs)
        return self._capture(inputs)

    def _fits(self, inputs: tuple) -> bool:
        """Whether these inputs can be copied into the static ones unchanged (a graph's shapes
        are fixed, so they always should: this keeps a wrong value impossible, not slow)."""
        return len(inputs) == len(self.static_inputs) and all(
            isinstance(given, torch.Tensor) and given.shape == static.shape and given.dtype == static.dtype
            and given.device == static.device for given, static in zip(inputs, self.static_inputs))

    def _replay(self, inputs: tuple) -> tuple:
        for static, given in zip(self.static_inputs, inputs):
            static.copy_(given)
        self.graph.replay()
        return tuple([output.clone() for output in self.static_outputs])

    def _capture(self, inputs: tuple):
        """This call's outputs, from the graph's first replay if it can be captured."""
        reason = uncapturable(inputs)
        if reason is not None:
            self.uncaptured = reason
            return self.function(*inputs)
        device = inputs[0].device if inputs else None
        current, side = torch.cuda.current_stream(device), _side_stream(device)
        static_inputs = tuple([torch.empty_like(given).copy_(given) for given in inputs])
        side.wait_stream(current)
        try:
            # lazy initialisations (cuBLAS workspaces, ...) happen here, not in the capture, and a
            # host sync is found here, before a capture begins (see _host_syncs_refused)
            with torch.cuda.stream(side), _host_syncs_refused():
                reason = uncapturable(static_inputs, self.function(*static_inputs))
        except RuntimeError as error:
            if HOST_SYNC not in str(error):   # the function's own failure: the caller's to report
                raise
            return self._run_uncaptured(inputs, f"the run reads a value on the host ({_reason(error)})")
        finally:
            current.wait_stream(side)
        if reason is not None:   # off the GPU or recorded by autograd: not a failure, nothing to warn of
            self.uncaptured = reason
            return self.function(*inputs)
        try:
            graph, static_outputs = self._record(side, static_inputs)
        except Exception as error:  # noqa: BLE001 -- CUDA's refusal to capture: the uncaptured call is the answer
            return self._run_uncaptured(inputs, _reason(error))
        self.graph, self.static_inputs, self.static_outputs = graph, static_inputs, static_outputs
        return self._replay(inputs)   # a capture runs nothing: the first replay computes this call

    def _run_uncaptured(self, inputs: tuple, reason: str):
        """This call, and every later one, without a graph; the worker says why once."""
        self.uncaptured = reason
        warnings.warn(f"dtorch.compile(backend='inductor'): a fused run on the GPU runs without a CUDA graph: "
                      f"{reason}", RuntimeWarning, stacklevel=3)
        return self.function(*inputs)

    def _record(self, side, static_inputs: tuple) -> tuple:
        """The captured graph (in a memory pool of its own) and its static outputs. The side
        stream stops being the current one whatever happens (torch.cuda.graph's exit skips that
        when ending the capture raises), and a failed capture's pool is let go of (below)."""
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    outputs = self.function(*static_inputs)
                finally:
                    graph.capture_end()
        except BaseException:
            _end_failed_capture(pool)
            raise
        return graph, tuple(outputs)


def _end_failed_capture(pool) -> None:
    """Tell torch's allocator that a failed capture is over. CUDAGraph.capture_end raises (the
    capture was invalidated) before it ends the allocator's routing to the capture's pool; left
    so, the allocator believes a capture is under way for good and from then on never reuses
    memory freed with pending uses on other streams (its deferred events wait for no capture),
    which every collective's inputs have. Where capture_end got that far, there is nothing to end."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:   # "not currently recording to" this pool: already ended
        return
    torch._C._cuda_releasePool(device, pool)


@contextlib.contextmanager
def _host_syncs_refused():
    """torch raises at a host sync (`.item()`, `.cpu()`, `nonzero`...) in the warm-up call, the
    commonest reason a capture fails, instead of inside the capture: a warm-up that fails leaves
    nothing behind, where a failed capture leaves torch's allocator to set right
    (_end_failed_capture). torch.cuda.synchronize() is not caught here: the capture refuses it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _reason(error: BaseException) -> str:
    """The first line of each error in the chain, the first one raised first (ending a failed
    capture raises again, and that one hides the cause)."""
    chain = []
    while error is not None and len(chain) < 3:
        lines = str(error).strip().splitlines()
        chain.append(f"{type(error).__name__}: {lines[0][:200] if lines else ''}")
        error = error.__cause__ or error.__context__
    return "; then ".join(reversed(chain))
