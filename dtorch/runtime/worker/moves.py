"""A worker's move commands: Redistribute (placements change on one mesh: slices locally, or
collectives on the communication stream), Transfer (blocks move to another mesh, point to point)
and the moves fused into a RunOp (RunOp.moves, run before the op reads its inputs).

MoveCommands is a component of the Worker (worker.py), which owns one: it takes the rank's
LocalShards (shards.py: its tensors, meshes and failures) and its Comms (comms.py: the
communicators, read at each use). The Worker asks it for a RunOp's moved inputs (moved_inputs).
"""
from __future__ import annotations

import torch

from ...spec.placements import DeviceMesh, local_region, narrow_to_box
from ...errors import ProtocolError
from ...spec.redistribute import LOCAL_ONLY, plan_transfer, step_kind
from .. import protocol as wire
from .fused_moves import run_moves
from .comms import Comms
from .kernels import apply_steps
from .op_arguments import refs_in_order
from .poisoned import Poisoned
from .shards import LocalShards

__all__ = ["MoveCommands"]


class MoveCommands:
    def __init__(self, shards: LocalShards, comms: Comms):
        self.shards, self.comms = shards, comms
        self.rank, self.device = shards.rank, shards.device

    def handle_redistribute(self, command: wire.Redistribute) -> None:
        mesh = self.shards.member(command.mesh_id)
        if mesh is None:
            return
        if command.grad:   # each step is recorded with its dual collective (kernels.apply_steps)
            with torch.enable_grad():
                return self._redistribute(command, mesh)
        self._redistribute(command, mesh)

    def _redistribute(self, command: wire.Redistribute, mesh: DeviceMesh) -> None:
        if _local_only(command.steps):  # slices and partializing: compute, no stream hop
            source = self.shards.tensor(command.src_id)
            self.shards.tensors[command.out_id] = apply_steps(source, command.shape, mesh, command.placements,
                                                       command.steps, self.rank, self.comms.comm)
            return
        if command.src_id not in self.shards.tensors and command.src_id in self.shards.poisoned:
            origin = self.shards.poisoned[command.src_id]
            try:
                self.device.communicate(lambda: self._stand_in(command, mesh), ())
            except Exception:  # noqa: BLE001 -- the input's failure comes first: the read names it
                pass
            raise Poisoned(origin)
        source = self.shards.held(command.src_id)
        out, done = self.device.communicate(
            lambda: apply_steps(source, command.shape, mesh, command.placements, command.steps,
                                self.rank, self.comms.comm, donated=command.donate), (source,))
        self.shards.keep(command.out_id, out, done)

    def _stand_in(self, command: wire.Redistribute, mesh: DeviceMesh) -> None:
        """A poisoned input still joins its collectives, with zeros, so the peers never wait.

        The peers' results are then meaningless but never readable: the poison stays on this
        rank's output, a read gathers every rank's status, and a move to another mesh (where
        this rank may not be) agrees on failures first. That saves a collective per redistribute.
        Should the stand-in fail too (a dtype the collective refuses on every rank alike), the
        output still carries the input's failure, not a failure of its own: a read names the
        first failure of its chain, not what followed from it."""
        _, shape = _region_of(command.shape, mesh, command.placements, self.rank)
        zeros = torch.zeros(shape, dtype=wire.dtype_from_name(command.dtype), device=self.device.torch_device)
        apply_steps(zeros, command.shape, mesh, command.placements, command.steps, self.rank, self.comms.comm)

    def handle_transfer(self, command: wire.Transfer) -> None:
        """Move a tensor to another mesh: point-to-point blocks, over NCCL between two CUDA meshes
        and over host (Gloo) channels otherwise, so a CPU mesh and a CUDA mesh can trade too.

        Every rank involved posts all its sends and receives, whatever happened to its input or
        its part of the move (zeros stand in), so no peer waits; then one agreement over the
        host channel poisons every output if any rank's input or part failed. A receiver thus
        never keeps blocks that a failed sender's zeros filled in, even off the sender's mesh."""
        src_mesh, dst_mesh = self.shards.meshes.get(command.src_mesh_id), self.shards.meshes.get(command.dst_mesh_id)
        involved = tuple(sorted({r for mesh in (src_mesh, dst_mesh) if mesh is not None for r in mesh.ranks}))
        if self.rank not in involved:
            return
        if src_mesh is None or dst_mesh is None:   # the controller re-announces meshes to late joiners
            raise ProtocolError(f"rank {self.rank}: transfer between meshes #{command.src_mesh_id} and "
                                f"#{command.dst_mesh_id}, and one of them was never defined here")
        source, origin, failure = None, -1, None
        if self.rank in src_mesh.ranks:
            try:
                source = self.shards.held(command.src_id)
            except Poisoned as poisoned:
                origin = poisoned.origin
            except KeyError as missing:
                failure = missing
        (out, failed_part), done = self.device.communicate(
            lambda: self._move_blocks(command, src_mesh, dst_mesh, source, involved),
            () if source is None else (source,))
        if origin < 0:   # (a part that failed with zeros for a poisoned input follows from that input)
            failure = failure or failed_part
        agreed = self.comms.agree_on_failure(involved, command.seq if failure is not None else origin)
        if failure is not None:
            raise failure
        if agreed >= 0:
            raise Poisoned(agreed)
        if out is not None:
            self.shards.keep(command.out_id, out, done)

    def _move_blocks(self, command: wire.Transfer, src_mesh, dst_mesh, source, involved: tuple):
        """This rank's part of plan_transfer: copy its own blocks, post every send and receive
        at once, then place what arrived. Returns (the new local tensor, or None off dst_mesh;
        the exception that failed this rank's part, or None). Without a source (its input
        failed) or after a failure, zeros are sent: the move must complete for the peers."""
        on_gpus = src_mesh.device_type == dst_mesh.device_type == "cuda"
        channel, staging = (self.comms.comm, self.device.torch_device) if on_gpus else (self.comms.host_comm, "cpu")
        dtype = wire.dtype_from_name(command.dtype)
        moves = plan_transfer(command.shape, src_mesh, command.src_placements, dst_mesh, command.dst_placements)
        outgoing = [(receiver, offset, box) for sender, receiver, offset, box in moves
                    if sender == self.rank != receiver]
        incoming = [(sender, offset, box) for sender, receiver, offset, box in moves if receiver == self.rank != sender]
        out = wanted = sends = receives = failure = None
        try:
            if self.rank in dst_mesh.ranks:
                wanted, local_shape = _region_of(command.shape, dst_mesh, command.dst_placements, self.rank)
                out = torch.empty(local_shape, dtype=dtype, device=self.device.torch_device)
            receives = [(sender, torch.empty(box, dtype=dtype, device=staging)) for sender, _, box in incoming]
            if source is not None:
                held = _region_of(command.shape, src_mesh, command.src_placements, self.rank)[0]
                for sender, receiver, offset, box in moves:
                    if sender == receiver == self.rank:
                        narrow_to_box(out, offset, box, wanted).copy_(narrow_to_box(source, offset, box, held))
                sends = [(receiver, narrow_to_box(source, offset, box, held).contiguous().to(staging))
                         for receiver, offset, box in outgoing]
        except Exception as error:  # out of memory, say: still take part, then report it
            failure = error
        if sends is None:
            sends = [(receiver, torch.zeros(box, dtype=dtype, device=staging)) for receiver, _, box in outgoing]
        if receives is None:
            receives = [(sender, torch.empty(box, dtype=dtype, device=staging)) for sender, _, box in incoming]
        channel.exchange(involved, sends, receives)
        if failure is None and out is not None:
            try:
                for (_, offset, box), (_, buffer) in zip(incoming, receives):
                    narrow_to_box(out, offset, box, wanted).copy_(buffer)
            except Exception as error:
                failure = error
        return out, failure

    def moved_inputs(self, command: wire.RunOp, mesh: DeviceMesh) -> dict:
        """{tensor_index: input after its move} for RunOp.moves, run on the communication stream
        before anything here can raise: every move joins its collectives (fused_moves.py), then
        a poisoned or missing input, or a failed step, raises for the whole op."""
        refs, sources, failure = refs_in_order(command), {}, None
        for index, *_ in command.moves:
            try:
                sources[index] = self.shards.held(refs[index].id)
            except (Poisoned, KeyError) as error:
                failure = failure or error
        (moved, failed), done = self.device.communicate(
            lambda: run_moves(command.moves, sources, mesh, self.rank, self.comms.comm, self.device.torch_device),
            tuple(sources.values()))
        failure = failure or failed
        if failure is not None:
            raise failure
        if done is not None:
            for tensor in moved.values():
                self.device.wait(done, tensor)
        return moved


def _local_only(steps) -> bool:
    return all(step_kind(before, after) in LOCAL_ONLY for _, before, after in steps)


def _region_of(shape, mesh: DeviceMesh, placements, rank: int):
    return local_region(shape, mesh, placements, mesh.coordinate_of(rank))
