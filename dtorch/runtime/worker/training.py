"""A worker's training commands: requires_grad flags, .grad, backward, optimizer steps and the
gradient-norm and gradient-update helpers of clip_grad_norm_.

TrainingCommands is a component of the Worker (worker.py), which owns one: it keeps the
data-parallel gradient buckets across backwards (`grad_buffers`) and takes the rank's LocalShards
(shards.py) and its Comms (comms.py: backward's collectives, its store and its agreements).
"""
from __future__ import annotations

import torch

from ...spec.placements import DeviceMesh
from .. import protocol as wire
from .backward import run_backward
from ..devices.comm import BackwardAbandoned
from .comms import Comms
from .grad_buckets import BucketBuffers
from .optim_kernels import local_norm_share, optimizer_step, state_names, update_grads
from .poisoned import Poisoned
from .shards import LocalShards

__all__ = ["TrainingCommands"]


class TrainingCommands:
    def __init__(self, shards: LocalShards, comms: Comms, fail_first_backward: bool = False):
        """`fail_first_backward`: fault injection for the tests of a failing backward (the
        Worker sets it from DTORCH_TEST_FAIL_BACKWARD_ON_RANK): the first Backward here fails
        at its start."""
        self.shards, self.comms, self.rank = shards, comms, shards.rank
        self.grad_buffers = BucketBuffers()   # data-parallel gradient buckets, kept across backwards
        self._fail_next_backward = fail_first_backward

    def handle_require_grad(self, command: wire.RequireGrad) -> None:
        for tensor_id in command.ids:
            tensor = self.shards.tensors.get(tensor_id)
            if tensor is not None:   # (a rank off the tensor's mesh holds nothing)
                tensor.requires_grad_(command.flag)

    def handle_set_grads(self, command: wire.SetGrads) -> None:
        for leaf_id, grad_id in zip(command.leaf_ids, command.grad_ids):
            leaf = self.shards.tensors.get(leaf_id)
            if leaf is not None:
                leaf.grad = None if grad_id < 0 else self.shards.held(grad_id)

    def handle_backward(self, command: wire.Backward) -> None:
        """torch's autograd over this rank's local graph, from the roots. Every rank of the mesh
        takes part (the collectives recorded in forward run their duals), so first the ranks
        agree whether any of them lost a root or seed to an earlier failure: then all skip."""
        mesh = self.shards.member(command.mesh_id)
        if mesh is None:
            return
        try:
            roots = [self.shards.tensor(i) for i in command.roots]
            seeds = [self.shards.tensor(i) for i in command.seeds]
            origin = -1
        except Poisoned as poisoned:
            origin = poisoned.origin
        agreed = self.comms.agree_on_failure(mesh.ranks, origin)
        if agreed >= 0:
            raise Poisoned(agreed)
        self._backward_together(mesh, command, roots, seeds)

    def _backward_together(self, mesh: DeviceMesh, command: wire.Backward, roots: list, seeds: list) -> None:
        """A rank whose own backward fails (out of memory, a missing derivative) says so in the
        store; the others, waiting for it in one of the backward's collectives, stop (comm's
        abort_key), and all settle the outcome over a group nothing else uses. After a failure,
        every rank drops the groups the backward ran on, so no half-finished collective stays."""
        gloo = self.comms.host_comm   # Gloo: the store and the settling group
        key = f"dtorch/backward-failed/{command.seq}"
        waiting = [c for c in self.comms.distinct() if hasattr(c, "abort_key")]
        for comm in waiting:    # (NCCL's collectives do not wait on the host: CUDA meshes are not covered)
            comm.abort_key = key
        failure = None
        try:
            if self._fail_next_backward:   # fault injection, for the tests of this path
                self._fail_next_backward = False
                raise RuntimeError(f"injected failure in backward on rank {self.rank}")
            run_backward(self.shards.tensors, roots, seeds, command, self.comms.comm, mesh, self.rank,
                         self.grad_buffers)
        except Exception as error:
            failure = error
            if not isinstance(error, BackwardAbandoned):
                gloo.store.set(key, b"1")
        finally:
            for comm in waiting:
                comm.abort_key = None
        if len(mesh.ranks) > 1 and gloo.settle(mesh.ranks, failure is not None):
            for comm in waiting:
                comm.renew(mesh.ranks, command.seq)
            if failure is None or isinstance(failure, BackwardAbandoned):
                raise Poisoned(command.seq)   # the rank that failed reports the error; here, only poison
        if failure is not None:
            raise failure

    def handle_optimizer_step(self, command: wire.OptimizerStep) -> None:
        """torch.optim's update, in place on this rank's shards (runtime/worker/optim_kernels.py)."""
        if self.shards.member(command.mesh_id) is None:
            return
        params = [self.shards.tensor(i) for i in command.param_ids]
        grads = [self.shards.tensor(i) for i in command.grad_ids]
        count = len(state_names(command.kind, command.hyper))
        ids = [command.state_ids[i * count:(i + 1) * count] for i in range(len(params))]
        states = [None if new else [self.shards.tensor(i) for i in own] for own, new in zip(ids, command.fresh)]
        buffers = optimizer_step(command.kind, command.hyper, params, grads, states, command.steps, command.fresh)
        for own, made in zip(ids, buffers):
            self.shards.tensors.update(zip(own, made))

    def handle_grad_norm(self, command: wire.GradNorm) -> None:
        mesh = self.shards.member(command.mesh_id)
        if mesh is None:
            return
        grads = [self.shards.tensor(i) for i in command.grad_ids]
        dtype = grads[0].dtype if grads else torch.float32
        self.shards.tensors[command.out_id] = local_norm_share(grads, command.placements, mesh.coordinate_of(self.rank),
                                                        command.norm_type, dtype)

    def handle_update_grads(self, command: wire.UpdateGrads) -> None:
        if self.shards.member(command.mesh_id) is None:
            return
        factor = self.shards.tensor(command.factor_id) if command.factor_id >= 0 else None
        update_grads(command.kind, [self.shards.tensor(i) for i in command.grad_ids], factor, command.bound)
