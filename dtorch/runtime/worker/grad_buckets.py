"""A worker's data-parallel gradient reduction inside a Backward command, as DDP does it: the
leaves' gradients are packed into the controller's buckets (autograd/rules.reduction_buckets)
and each bucket is all-reduced as soon as every gradient in it has been accumulated, while the
engine goes on with the rest of the graph.

Order is what keeps this safe. Every member launches the buckets in the same order (bucket i
only after buckets 0..i-1), whenever its own engine gets there, and they travel on a group of
their own (Communicator.start_all_reduce: Gloo's own threads on CPU; on GPUs an NCCL
communicator of their own, on a stream of their own that waits for the packing by event), so
they never meet the backward's other collectives in a different order on different ranks. A
bucket whose leaf this rank's graph never reached (its gradient is zeros here) goes out after
the engine returns, still in order. Where a communicator cannot run beside the others
(background_collectives False: shared-GPU mode), every bucket goes out after the engine returns.

When all have finished, each leaf's .grad is its piece of the reduced buffer (a view, as DDP's
gradient_as_bucket_view), so later backwards accumulate into it in place.

The buffers are kept from one Backward to the next (BucketBuffers), as DDP keeps its buckets: a
fresh 14 MiB buffer per step costs its page faults again, 5 ms of a worker's CPU per step when
large buffers go back to the OS. A kept buffer is reused only once nothing else holds its
storage (the step read the gradients and zero_grad dropped them): a gradient the user still
holds is never overwritten.
"""
from __future__ import annotations

import torch

__all__ = ["BucketReducer", "BucketBuffers"]


class BucketBuffers:
    """One worker's flat bucket buffers, by (bucket index, elements, dtype, device)."""

    def __init__(self):
        self.kept: dict = {}

    def take(self, index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (index, numel, like.dtype, like.device)
        kept = self.kept.get(key)
        if kept is not None and _unshared(kept):
            return kept
        fresh = torch.empty(numel, dtype=like.dtype, device=like.device)
        if like.device.type == "cpu":   # a GPU stream may still read the old one: the caching allocator knows
            self.kept[key] = fresh
        return fresh


def _unshared(buffer: torch.Tensor) -> bool:
    """Nothing but this reference holds the buffer's storage: no gradient view of it is alive.
    (The count includes the storage object asked for here; torch's cudagraph trees check alike.)"""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(buffer.untyped_storage()._cdata) <= 2


class BucketReducer:
    def __init__(self, comm, mesh, rank: int, inputs: list, buckets: tuple, buffers: BucketBuffers):
        self.comm, self.buffers = comm, buffers
        self.plans = []   # (group ranks, [leaf tensor, ...]) per bucket, in launch order
        for dims, members in buckets:
            if not all(0 <= d < mesh.ndim for d in dims) or not all(0 <= i < len(inputs) for i in members):
                raise ValueError(f"a gradient bucket ({dims}, {members}) outside the mesh's {mesh.ndim} dims or "
                                 f"the backward's {len(inputs)} inputs")
            self.plans.append((mesh.group_over(rank, dims), [inputs[i] for i in members]))
        self.missing = [len({id(leaf) for leaf in leaves}) for _, leaves in self.plans]
        self.started: list = []   # per launched bucket: what finishes its all-reduce
        self.hooks: list = []

    def __enter__(self) -> BucketReducer:
        for ranks, _ in self.plans:   # collectively, before any engine runs ahead of a peer
            self.comm.prepare_background(ranks)
        if self.comm.background_collectives:
            seen = set()
            for index, (_, leaves) in enumerate(self.plans):
                for leaf in leaves:
                    if id(leaf) not in seen:
                        seen.add(id(leaf))
                        self.hooks.append(leaf.register_post_accumulate_grad_hook(
                            lambda _leaf, index=index: self._arrived(index)))
        return self

    def __exit__(self, *failure) -> None:
        for hook in self.hooks:
            hook.remove()

    def _arrived(self, index: int) -> None:
        self.missing[index] -= 1
        while len(self.started) < len(self.plans) and self.missing[len(self.started)] == 0:
            self._launch(len(self.started))

    def _launch(self, index: int) -> None:
        ranks, leaves = self.plans[index]
        flat = self.buffers.take(index, sum(leaf.numel() for leaf in leaves), leaves[0])
        torch.cat([_grad_of(leaf).reshape(-1) for leaf in leaves], out=flat)
        self.started.append(self.comm.start_all_reduce(ranks, flat, "sum"))

    def finish(self) -> None:
        """After the engine: launch what has not gone out yet, in order; wait for every bucket
        and give each leaf its piece of the reduced buffer as .grad."""
        while len(self.started) < len(self.plans):
            self._launch(len(self.started))
        for (_, leaves), finish in zip(self.plans, self.started):
            reduced, offset = finish(), 0
            for leaf in leaves:
                leaf.grad = reduced[offset:offset + leaf.numel()].view(leaf.shape)
                offset += leaf.numel()


def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    """The leaf's accumulated gradient; zeros where this rank's graph did not reach it."""
    grad = leaf.grad
    return torch.zeros_like(leaf) if grad is None or grad._is_zerotensor() else grad
