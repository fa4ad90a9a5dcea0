"""SharedGpuCommunicator: the communicator of shared-GPU mode (dtorch.init(share_gpu=True) or
DTORCH_SHARE_GPU=1), a test and development mode in which several CUDA workers share one GPU.

NCCL refuses two ranks on one device, so this communicator stages every collective through host
memory and runs it over the worker's Gloo communicator: copy the inputs to the host, run Gloo's
collective, copy the result back to the GPU. Everything above the communicator (the compute and
communication streams of CudaDevice, redistributes, buckets, grouped gathers, compile replays,
checkpoints, recovery) is the code that runs with NCCL; only this class differs. It keeps NCCL's
contract where callers can tell: a one-rank group moves nothing, and the host channel (`host`)
is a Gloo communicator of its own object, which the worker closes and regroups as it does
NCCL's. One difference is chosen: background_collectives is False, so the buckets go out after
the backward's engine returns (NCCL's run beside it on a stream of their own; staged through the
host on the engine's thread, they would stall it instead).

Staging copies synchronize the current stream (the communication stream inside a redistribute),
which NCCL never does: results are the same, overlap is not, so never time this mode. On CPU
tensors the same code runs with plain copies, which is how tests/test_share_gpu.py checks it
without a GPU.
"""
from __future__ import annotations

import torch

from .comm import GlooCommunicator, finish_reduction

__all__ = ["SharedGpuCommunicator"]


class SharedGpuCommunicator:
    background_collectives = False   # see the module doc and Communicator.background_collectives

    def __init__(self, store_address: str, rank: int, hostname: str, timeout_s: float = 300.0,
                 device=None):
        self.rank = rank
        self.host = GlooCommunicator(store_address, rank, hostname, timeout_s)
        self.torch_device = device.torch_device if device is not None else torch.device("cpu")

    # --- staging: the one thing this class adds to Gloo ---------------------------------------
    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of `tensor` (copy=True: Gloo may write into what it is given)."""
        return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)

    def _back(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new tensor on this worker's device, copied on the current stream."""
        return tensor.to(self.torch_device, copy=True)

    # --- collectives over one group; every member calls the same one -------------------------
    # A one-rank group moves nothing and stays on the GPU, as NCCL's skips it: a (1,) mesh costs
    # what it costs with NCCL, which is what scripts/gpu_check.sh times.
    def all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """In place, as NCCL's (the caller passes a contiguous tensor); use the returned tensor."""
        if len(ranks) == 1:
            return finish_reduction(tensor, reduce_op, ranks)
        reduced = self.host.all_reduce(ranks, self._staged(tensor), reduce_op)
        return tensor.copy_(reduced)

    def prepare_background(self, ranks: tuple) -> None:
        self.host.group(ranks)

    def start_all_reduce(self, ranks: tuple, tensor: torch.Tensor, reduce_op: str):
        """Done at once: its callers (background_collectives False) order it after the rest."""
        result = self.all_reduce(ranks, tensor, reduce_op)
        return lambda: result

    def all_gather(self, ranks: tuple, tensor: torch.Tensor) -> torch.Tensor:
        if len(ranks) == 1:
            return tensor.unsqueeze(0).clone(memory_format=torch.contiguous_format)
        return self._back(self.host.all_gather(ranks, self._staged(tensor)))

    def start_all_gather(self, ranks: tuple, tensor: torch.Tensor):
        """Done at once, as NCCL's is enqueued at once (fully_shard's prefetch): in the caller's
        order among its other collectives, so the order holds on every member."""
        return self.all_gather(ranks, tensor), lambda: None

    def reduce_scatter(self, ranks: tuple, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if len(ranks) == 1:
            return finish_reduction(stacked[0].clone(memory_format=torch.contiguous_format), reduce_op, ranks)
        return self._back(self.host.reduce_scatter(ranks, self._staged(stacked), reduce_op))

    def all_to_all(self, ranks: tuple, send: torch.Tensor) -> torch.Tensor:
        if len(ranks) == 1:
            return send.clone(memory_format=torch.contiguous_format)
        return self._back(self.host.all_to_all(ranks, self._staged(send)))

    def exchange(self, ranks: tuple, sends: list, receives: list) -> None:
        """Each received tensor is written in place once every transfer has finished."""
        if len(ranks) == 1:
            return
        staged = [(peer, torch.empty(t.shape, dtype=t.dtype)) for peer, t in receives]
        self.host.exchange(ranks, [(peer, self._staged(t)) for peer, t in sends], staged)
        for (_, target), (_, arrived) in zip(receives, staged):
            target.copy_(arrived)

    def agree_max(self, ranks: tuple, value: int) -> int:
        return self.host.agree_max(ranks, value)

    def regroup(self, generation: int, replaced: tuple) -> None:
        """Nothing of its own: every group is the host communicator's, which the worker regroups
        (comms.Comms.regroup), as it does NCCL's host communicator."""

    def close(self) -> None:
        self.host.close()
