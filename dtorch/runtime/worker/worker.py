"""A worker: one process per device. It runs the controller's commands strictly in order on its
local shards, one handler per command type (named after it), and answers only reads.

A worker process starts as `python -m dtorch.runtime.processes.worker_process` (start-up lives there).
The handlers of moves (Redistribute, Transfer, a RunOp's fused moves) are in worker/moves.py,
of dtorch.compile's graphs in worker/graph_commands.py, of training commands (backward, optimizer steps)
in worker/training.py, of checkpoint files in worker/files.py and of activation checkpointing in
checkpoint_regions.py: Worker inherits them. How a RunOp's arguments are read (tensor references,
rank-local values, inputs recorded for backward) is op_arguments.py.

A command that raises does not stop the worker: its outputs become "poisoned" with the command's
seq, the error goes back tagged with that seq, and anything computed from a poisoned tensor is
poisoned in turn (the poison stays on this rank through collectives; moves to another mesh agree
on it first), so no read ever returns a wrong value.
"""
from __future__ import annotations

import itertools
import os
import threading
import traceback
import warnings

import torch

from ...spec.placements import DeviceMesh, ShardRegion, local_region, nest_ranks
from ...errors import ProtocolError
from ...ops import KERNELS
from ...ops.registry import PEER_KERNELS
from .. import protocol as wire
from ..devices.comm import Communicator
from . import graphs
from .backward import run_recorded
from .grad_buckets import BucketBuffers
from . import fsdp_gather  # noqa: F401  (registers fully_shard's grouped gather kernel)
from .kernels import apply_steps, make_factory
from .op_arguments import SCALAR_TYPES, grad_inputs, is_flat, map_refs, recorded_inline, refs_in_order
from .peers import Peers
from .poisoned import Poisoned
from ..protocol import TensorRef
from ..transport import WorkerSockets
from .checkpoint_regions import RegionCommands
from .files import CheckpointCommands
from .graph_commands import GraphCommands
from .moves import MoveCommands
from .profiling import CommandRecorder, clock_frame
from .training import TrainingCommands

__all__ = ["Worker", "Poisoned"]


class Worker(MoveCommands, GraphCommands, TrainingCommands, CheckpointCommands, RegionCommands):
    def __init__(self, rank: int, sockets: WorkerSockets, comm: Communicator, device, start_seq: int,
                 host_comm: Communicator | None = None):
        self.rank, self.sockets, self.comm, self.device = rank, sockets, comm, device
        self.host_comm = host_comm or comm   # Gloo: transfers between meshes, CPU or not
        self.next_seq = self.start_seq = start_seq
        self.tensors: dict[int, torch.Tensor] = {}
        self.poisoned: dict[int, int] = {}          # tensor id -> seq of the command that failed
        self.in_flight: dict[int, object] = {}      # tensor id -> event of the communication making it
        self.meshes: dict[int, DeviceMesh] = {}
        self.private: dict[int, list] = {}          # command seq -> raw frames sent to this rank
        self.graphs: dict[int, graphs.Graph] = {}   # dtorch.compile: graph id -> captured commands
        self.grad_buffers = BucketBuffers()   # data-parallel gradient buckets, kept across backwards
        self.outgoing: list = []                    # (HostCopy, wire.Reply): replies waiting on the device
        self.running = True
        self.busy_seq = -1                          # the command running now (read by the heartbeat)
        self._loop_thread = self._show_warning = None   # set by run(): warnings go to the controller
        self._inputs = ()                           # the local inputs of the op running now (warnings)
        self.profiler: CommandRecorder | None = None   # set while dtorch.profile records (handle_profile)
        self._handlers = {cls: getattr(self, wire.handler_name(cls)) for cls in wire.COMMANDS}
        # fault injection for tests/test_training.py: this rank's first Backward fails at its start
        self._fail_next_backward = os.environ.get("DTORCH_TEST_FAIL_BACKWARD_ON_RANK") == str(rank)

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        torch.set_grad_enabled(False)   # only commands that say `grad` record for backward
        self._loop_thread = threading.get_ident()
        with warnings.catch_warnings():   # the filters and showwarning as they were, once the loop ends
            self._show_warning, warnings.showwarning = warnings.showwarning, self._forward_warning
            warnings.simplefilter("always")   # the controller's filters judge a repeat, by the user's line
            warnings.filterwarnings("ignore", category=ResourceWarning)   # this process's own, never an op's
            try:
                self._loop()
            except ProtocolError as error:
                # The command stream cannot be trusted any more: say why, then stop for good.
                self.sockets.send([wire.encode(wire.ErrorReport(self.next_seq, self.rank, wire.PROTOCOL_FAILURE,
                                                                "ProtocolError", str(error), ""))])
                raise

    def _forward_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """warnings.showwarning while the loop runs. A warning that a command raises goes to the
        controller, which shows it at the user's line: printed here, it came once per rank and
        named this file. Every repeat goes too, since only the controller knows the user's line
        that Python's filters judge repeats by. One raised by an op with an empty local input is
        dropped: where the whole tensor is not empty, it is the shard's, not the op's. Any other
        warning (another thread's, or between commands) prints here."""
        if self.busy_seq < 0 or threading.get_ident() != self._loop_thread:
            return self._show_warning(message, category, filename, lineno, file, line)
        if any(type(a) is torch.Tensor and a.numel() == 0 for a in self._inputs):
            return   # an empty shard's (std over 0 rows): torch on the whole tensor does not warn
        report = wire.WarningReport(self.busy_seq, self.rank, category.__name__, str(message))
        self.sockets.send([wire.encode(report)])

    def _loop(self) -> None:
        while self.running:
            frames = self.sockets.receive_command(timeout_ms=1 if self.outgoing else None)
            if self.outgoing:
                self._send_ready()
            if frames is None:
                continue
            self._on_message(frames)

    def _on_message(self, frames: list) -> None:
        """One message from the command socket; ProtocolError if it is not one of ours."""
        if len(frames) < 2:
            raise ProtocolError(f"rank {self.rank}: a message of {len(frames)} frame(s) on the command socket")
        message = wire.decode(frames[1].bytes, _ON_COMMAND_SOCKET)
        if type(message) is wire.Batch:
            if len(frames) != 3:
                raise ProtocolError(f"rank {self.rank}: a batch of {len(frames)} frames, not 3")
            self._run_batch(message, frames[2].buffer)
        elif type(message) is wire.Private and message.seq >= self.next_seq:
            self.private[message.seq] = frames[2:]

    def _run_batch(self, batch: wire.Batch, body) -> None:
        commands = wire.decode_batch(batch, body)
        if batch.first_seq < self.next_seq:
            return  # published before this worker joined
        if batch.first_seq != self.next_seq:
            raise ProtocolError(f"rank {self.rank}: expected command #{self.next_seq}, got #{batch.first_seq}: "
                                "commands were lost on the way")
        self.next_seq = commands[-1].seq + wire.span(commands[-1]) if commands else self.next_seq
        with self.device.compute():   # once a batch, for the plain ops that run inline (_ran_inline)
            for command in commands:
                self._run_command(command)

    def _run_command(self, command) -> None:
        if self.region is not None:   # dtorch.utils.checkpoint (checkpoint_regions.py)
            self._run_in_region(command)
        elif self.profiler is not None or not self._ran_inline(command):   # profiling off: one check
            self._execute_or_record(command)

    def _execute_or_record(self, command) -> None:
        if self.profiler is not None:
            self.profiler.record(command, self._execute)
        else:
            self._execute(command)

    def _ran_inline(self, command) -> bool:
        """Run a plain op here and say True; False leaves the command to the general path.

        Plain means: tensors and scalars in, scalar kwargs, nothing to slice, no peers,
        no communication in flight, and every input here. Most commands of a small-op program
        are such ops, and _execute's layers (the handler table, handle_run_op, _run_op, a method
        call per input) cost about as much as the op itself. The general path takes everything
        else, including a missing or poisoned input, whose error it words. The caller has entered
        the compute stream (_run_batch; a RunGraph runs inside _execute). A failure here is
        handled as _execute handles one: poisoned outputs and a report under the command's seq."""
        if (type(command) is not wire.RunOp or command.input_steps or command.moves or self.in_flight
                or command.kernel in PEER_KERNELS or not is_flat(command.args)
                or (command.kwargs and not SCALAR_TYPES.issuperset(map(type, command.kwargs.values())))
                or self._member(command.mesh_id) is None):
            return False
        tensors = self.tensors
        try:
            args = [tensors[a.id] if type(a) is TensorRef else a for a in command.args]
        except KeyError:
            return False
        self.busy_seq, self._inputs = command.seq, args
        try:
            if command.grad:
                self._store(command.out_ids, recorded_inline(KERNELS[command.kernel], args, command.kwargs,
                                                             command.regather))
            else:
                self._store(command.out_ids, KERNELS[command.kernel](*args, **command.kwargs))
        except Exception as error:  # any failure of one command; the worker goes on
            self._failed(command, error)
        finally:
            self.busy_seq, self._inputs = -1, ()
        return True

    def _execute(self, command) -> None:
        self.busy_seq = command.seq   # the heartbeat thread reports a command that runs too long
        try:
            with self.device.compute():
                self._handlers[type(command)](command)
        except Poisoned as poisoned:
            self._poison(command, poisoned.origin)
        except Exception as error:  # any failure of one command; the worker goes on
            self._failed(command, error)
        finally:
            self.busy_seq, self._inputs = -1, ()

    def _failed(self, command, error: Exception) -> None:
        self._poison(command, command.seq)
        self._report(command, error)

    def _poison(self, command, origin: int) -> None:
        for tensor_id in _outputs_of(command):
            self.tensors.pop(tensor_id, None)
            self.in_flight.pop(tensor_id, None)
            self.poisoned[tensor_id] = origin

    def _report(self, command, error: Exception) -> None:
        op = getattr(command, "op", None) or getattr(command, "kind", None) or type(command).__name__
        report = wire.ErrorReport(command.seq, self.rank, op, type(error).__name__, str(error),
                                  "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.sockets.send([wire.encode(report)])

    # --- helpers shared by handlers -------------------------------------------------------------
    def _member(self, mesh_id: int) -> DeviceMesh | None:
        """The mesh if this rank belongs to it. A mesh defined before this worker joined the
        pool is unknown here, and cannot include it."""
        mesh = self.meshes.get(mesh_id)
        return mesh if mesh is not None and self.rank in mesh.ranks else None

    def _tensor(self, tensor_id: int) -> torch.Tensor:
        """A tensor for the compute stream to read: if a communication still in flight makes it,
        the compute stream waits for that first (on the device; this thread goes on)."""
        tensor = self._held(tensor_id)
        if self.in_flight and tensor_id in self.in_flight:
            self.device.wait(self.in_flight.pop(tensor_id), tensor)
        return tensor

    def _held(self, tensor_id: int) -> torch.Tensor:
        """A tensor as stored, for communication, which is ordered after compute by itself."""
        tensor = self.tensors.get(tensor_id)
        if tensor is None:
            if tensor_id in self.poisoned:
                raise Poisoned(self.poisoned[tensor_id])
            raise KeyError(f"tensor #{tensor_id} is not on rank {self.rank} (freed, or never created)")
        return tensor

    def _keep(self, tensor_id: int, tensor: torch.Tensor, done) -> None:
        self.tensors[tensor_id] = tensor
        if done is not None:
            self.in_flight[tensor_id] = done

    @staticmethod
    def _input_ids(command) -> list:
        """The ids a RunOp or Redistribute reads."""
        if type(command) is wire.Redistribute:
            return [command.src_id]
        return [ref.id for ref in refs_in_order(command)]

    def _agree_on_failure(self, ranks: tuple, origin: int) -> int:
        """The earliest failure origin (a command seq) any of `ranks` passed, -1 for none, over
        the host channel. Every rank involved must call it, failed or not. The earliest, as a
        read picks among its ranks' statuses (reads.FetchRead.finish): a later origin may be a
        failure that followed from it, and a read names the first failure of its chain."""
        if len(ranks) == 1:
            return origin
        agreed = self.host_comm.agree_max(ranks, -origin if origin >= 0 else _NO_FAILURE)
        return -agreed if agreed != _NO_FAILURE else -1

    # --- handlers: one per command ---------------------------------------------------------------
    def handle_define_mesh(self, command: wire.DefineMesh) -> None:
        self.meshes[command.mesh_id] = DeviceMesh(command.device_type, nest_ranks(command.ranks, command.shape))

    def handle_factory(self, command: wire.Factory) -> None:
        mesh = self._member(command.mesh_id)
        if mesh is None:
            return
        dtype = wire.dtype_from_name(command.dtype)
        self.tensors[command.out_id] = make_factory(
            command.kind, command.shape, dtype, mesh, command.placements,
            mesh.coordinate_of(self.rank), command.args, self.device.torch_device)

    def handle_upload(self, command: wire.Upload) -> None:
        mesh = self._member(command.mesh_id)
        if mesh is None:
            return
        frames = self.private.pop(command.seq, None)
        if frames is None:
            raise ProtocolError(f"rank {self.rank}: upload data for command #{command.seq} never arrived")
        _, shape = local_region(command.shape, mesh, command.placements, mesh.coordinate_of(self.rank))
        data = wire.tensor_from_frame(frames[0].buffer, wire.dtype_from_name(command.dtype), shape)
        self.tensors[command.out_id] = self.device.from_host(data)

    def handle_run_op(self, command: wire.RunOp) -> None:
        mesh = self._member(command.mesh_id)
        if mesh is None:
            return
        if command.grad:   # torch records the local op for backward (workers run with grad off)
            with torch.enable_grad():
                return self._run_op(command, mesh)
        self._run_op(command, mesh)

    def _run_op(self, command: wire.RunOp, mesh: DeviceMesh) -> None:
        if command.kernel in PEER_KERNELS:
            return self._run_with_peers(command, mesh)
        if command.input_steps or command.moves or not is_flat(command.args):
            args, kwargs = self._localized_args(command, mesh)
        else:  # the common case: top-level tensors and scalars, nothing to slice
            tensor = self._tensor
            args = [tensor(a.id) if type(a) is TensorRef else a for a in command.args]
            kwargs = map_refs(command.kwargs, lambda ref: tensor(ref.id), self._place(mesh)) if command.kwargs else {}
        self._inputs = args
        if command.grad:
            result = run_recorded(KERNELS[command.kernel], grad_inputs(args, kwargs), args, kwargs, command.regather)
        else:
            result = KERNELS[command.kernel](*args, **kwargs)
        self._store(command.out_ids, result)

    def _store(self, out_ids: tuple, result) -> None:
        if isinstance(result, (tuple, list)):
            for tensor_id, value in zip(out_ids, result):
                self.tensors[tensor_id] = value
        else:
            self.tensors[out_ids[0]] = result

    def _localized_args(self, command: wire.RunOp, mesh: DeviceMesh):
        """Resolve tensors depth-first; run the fused moves, then slice the Replicate inputs the
        op needs as shards."""
        local_steps = {index: rest for index, *rest in command.input_steps}
        moved = self._moved_inputs(command, mesh) if command.moves else {}
        numbering = itertools.count()

        def local(ref: TensorRef) -> torch.Tensor:
            index = next(numbering)
            tensor = moved[index] if index in moved else self._tensor(ref.id)
            if index in local_steps:
                shape, placements, steps = local_steps[index]
                # local steps (slices) communicate nothing, so a rank records one only for an input
                # that requires grad: torch refuses a grad-requiring weight where it has no derivative
                with torch.set_grad_enabled(tensor.requires_grad and torch.is_grad_enabled()):
                    tensor = apply_steps(tensor, shape, mesh, placements, steps, self.rank, self.comm)
            return tensor
        place = self._place(mesh)
        return map_refs(command.args, local, place), map_refs(command.kwargs, local, place)

    def _place(self, mesh: DeviceMesh):
        """The rank-local value of a ShardRegion (where this rank's block sits: (offset, shape))
        or of a PeerGroup (this rank's peers along a mesh dim, over the communicator)."""
        def place(value):
            if type(value) is ShardRegion:
                return value.at(mesh, mesh.coordinate_of(self.rank))
            return Peers(value, mesh, self.rank, self.comm)
        return place

    def _run_with_peers(self, command: wire.RunOp, mesh: DeviceMesh) -> None:
        """A kernel that exchanges blocks with its peers: it runs on every member, on the
        communication stream. If this rank's input failed it still runs, with stand-in zeros
        (`standin=True`), so the others never wait; its output is then poisoned."""
        try:
            args, kwargs = self._localized_args(command, mesh)
            failed = None
        except Poisoned as poisoned:
            failed = poisoned
            args = [None if type(a) is TensorRef else a for a in command.args]
            kwargs = map_refs(command.kwargs, lambda ref: None, self._place(mesh))
            kwargs["standin"] = True
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        try:
            out, done = self.device.communicate(lambda: KERNELS[command.kernel](*args, **kwargs), tensors)
        except Exception:
            if failed is None:
                raise
        if failed is not None:   # even if the stand-in failed too: the input's failure comes first
            raise failed
        for tensor_id, tensor in zip(command.out_ids, out if isinstance(out, (tuple, list)) else (out,)):
            self._keep(tensor_id, tensor, done)

    def handle_fetch(self, command: wire.Fetch) -> None:
        mesh = self._member(command.mesh_id)
        if mesh is None:
            return
        if command.tensor_id in self.poisoned:
            status, frames = ("poisoned", self.poisoned[command.tensor_id]), []
        elif command.tensor_id not in self.tensors:
            status, frames = ("missing", -1), []
        elif self.rank in command.senders:
            tensor = self._tensor(command.tensor_id)
            small = None if self.outgoing else self.device.small_bytes(tensor)   # (replies leave in order)
            if small is None:
                # The reply leaves when the device-to-host copy is done, without stalling this loop.
                self.outgoing.append((self.device.to_host(tensor), wire.Reply(command.seq, self.rank, "ok", -1)))
                self._send_ready()
                return
            status, frames = ("ok", -1), [small]
        else:
            status, frames = ("ok", -1), []
        self.sockets.send([wire.encode(wire.Reply(command.seq, self.rank, *status))] + frames)

    def _send_ready(self) -> None:
        waiting = []
        for copy, reply in self.outgoing:
            if not copy.ready():
                waiting.append((copy, reply))
                continue
            if copy.tensor is None:   # a fence: the reply carries no bytes
                self.sockets.send([wire.encode(reply)])
                continue
            try:
                frame = wire.tensor_frame(copy.tensor)
            except Exception as error:  # the read fails, the worker goes on
                self._report(wire.Fetch(reply.seq, -1, -1, ()), error)
                self.sockets.send([wire.encode(wire.Reply(reply.seq, self.rank, "poisoned", reply.seq))])
                continue
            self.sockets.send([wire.encode(reply), frame])
        self.outgoing = waiting

    def handle_free(self, command: wire.Free) -> None:
        for tensor_id in command.ids:
            self.tensors.pop(tensor_id, None)
            self.poisoned.pop(tensor_id, None)
            self.in_flight.pop(tensor_id, None)

    def handle_sync(self, command: wire.Sync) -> None:
        """Reply once the device has run everything before this command (at once on CPU)."""
        self.outgoing.append((self.device.fence(), wire.Reply(command.seq, self.rank, "ok", -1)))
        self._send_ready()

    def handle_shutdown(self, command: wire.Shutdown) -> None:
        self.running = False

    def handle_profile(self, command: wire.Profile) -> None:
        """Profiling on (again while on: a clock ping) or off; the reply carries this rank's clock,
        and when it turns off every command recorded (runtime/worker/profiling.py). It leaves at
        once: the controller times the round trip to align this worker's clock with its own."""
        if command.on:
            if self.profiler is None:
                self.profiler = CommandRecorder(self)
            frame = clock_frame()
        elif self.profiler is not None:
            recorder, self.profiler = self.profiler, None
            frame = recorder.finish()
        else:   # off without on (this worker joined while profiling was on): nothing recorded
            frame = clock_frame([])
        self.sockets.send([wire.encode(wire.Reply(command.seq, self.rank, "ok", -1)), frame])

    def handle_regroup(self, command: wire.Regroup) -> None:
        """Lost ranks were replaced: no group holding one is used again (comm.regroup). Poison
        and tensors of the old processes are the controller's to refuse; nothing here holds them."""
        for comm in {id(self.comm): self.comm, id(self.host_comm): self.host_comm}.values():
            comm.regroup(command.generation, command.replaced)

_ON_COMMAND_SOCKET = (wire.Batch, wire.Private, wire.Probe)   # probes need no answer once registered
# What a rank without a failure passes to agree_max in _agree_on_failure, which agrees on the
# earliest origin as the largest negated one: below every negated seq.
_NO_FAILURE = -(1 << 62)


def _outputs_of(command) -> tuple:
    if hasattr(command, "out_ids"):
        return command.out_ids
    return (command.out_id,) if hasattr(command, "out_id") else ()


