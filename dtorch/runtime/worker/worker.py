"""A worker: one process per device. It runs the controller's commands strictly in order on its
local shards, one handler per command type (named after it), and answers only reads.

A worker process starts as `python -m dtorch.runtime.processes.worker_process` (start-up lives there).
The Worker runs the loop, the ops and the commands of its own state (meshes, uploads, reads, frees);
the other handlers belong to components it owns, one per topic, each given what it uses: moves
(Redistribute, Transfer, a RunOp's fused moves) in worker/moves.py, dtorch.compile's graphs in
worker/graph_commands.py, training commands (backward, optimizer steps) in worker/training.py,
checkpoint files in worker/files.py and activation checkpointing in checkpoint_regions.py. They
share the rank's tensors (shards.LocalShards) and communicators (comms.Comms); the two that run
commands of their own take the Worker as a small Protocol (graph_commands.CommandRunner,
checkpoint_regions.RegionRunner). How a RunOp's arguments are read (tensor references,
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
from collections.abc import Callable

import torch

from ...spec.placements import DeviceMesh, ShardRegion, local_region, nest_ranks
from ...errors import ProtocolError
from ...ops import KERNELS
from ...ops.registry import PEER_KERNELS
from .. import protocol as wire
from ..devices.comm import Communicator
from .backward import run_recorded
from . import compile_counters, fsdp_gather  # noqa: F401  (register their kernels: compile counters, fully_shard's gather)
from .kernels import apply_steps, make_factory
from .op_arguments import SCALAR_TYPES, grad_inputs, is_flat, map_refs, recorded_inline
from .peers import Peers
from .poisoned import Poisoned
from ..protocol import TensorRef
from ..transport import WorkerSockets
from .checkpoint_regions import RegionCommands
from .comms import Comms
from .files import CheckpointCommands
from .graph_commands import GraphCommands
from .moves import MoveCommands
from .profiling import CommandRecorder, clock_frame
from .shards import LocalShards
from .training import TrainingCommands

__all__ = ["Worker", "Poisoned", "handler_table"]


class Worker:
    def __init__(self, rank: int, sockets: WorkerSockets, comm: Communicator, device, start_seq: int,
                 host_comm: Communicator | None = None):
        self.rank, self.sockets, self.device = rank, sockets, device
        self.comms = Comms(comm, host_comm)   # host_comm (Gloo): transfers between meshes, CPU or not
        self.shards = shards = LocalShards(rank, device)
        # What the per-op path (_ran_inline, _run_op) reads, held here: no hop through shards per op.
        # The dicts are the shards' own, never replaced (shards.py).
        self.tensors, self.in_flight = shards.tensors, shards.in_flight
        self._member, self._tensor, self._store = shards.member, shards.tensor, shards.store
        self.next_seq = self.start_seq = start_seq
        self.private: dict[int, list] = {}          # command seq -> raw frames sent to this rank
        self.outgoing: list = []                    # (HostCopy, wire.Reply): replies waiting on the device
        self.running = True
        self.busy_seq = -1                          # the command running now (read by the heartbeat)
        self._loop_thread = self._show_warning = None   # set by run(): warnings go to the controller
        self._inputs = ()                           # the local inputs of the op running now (warnings)
        self.profiler: CommandRecorder | None = None   # set while dtorch.profile records (handle_profile)
        self.diverted: Callable | None = None       # takes every command while a checkpoint region is open
        # The handlers of each topic: components given what they use.
        self.moves = MoveCommands(shards, self.comms)
        self.graph_commands = GraphCommands(shards, self, start_seq)
        # fault injection for tests/test_training.py: this rank's first Backward fails at its start
        failing = os.environ.get("DTORCH_TEST_FAIL_BACKWARD_ON_RANK") == str(rank)
        self.training = TrainingCommands(shards, self.comms, fail_first_backward=failing)
        self.files = CheckpointCommands(shards)
        self.checkpoint_regions = RegionCommands(shards, self)
        self._handlers = handler_table(wire.COMMANDS, (self, self.moves, self.graph_commands, self.training,
                                                       self.files, self.checkpoint_regions))

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
                self.run_command(command)

    def run_command(self, command) -> None:
        """One command of the stream: its handler's failure poisons its outputs and is reported."""
        if self.diverted is not None:   # dtorch.utils.checkpoint (checkpoint_regions.py)
            self.diverted(command)
        elif self.profiler is not None or not self._ran_inline(command):   # profiling off: one check
            self.execute_or_record(command)

    def execute_or_record(self, command) -> None:
        """run_command past the checks for a region and an inline op: recorded while profiling."""
        if self.profiler is not None:
            self.profiler.record(command, self._execute)
        else:
            self._execute(command)

    def divert(self, run: Callable | None) -> None:
        """From now on run_command passes each command to `run`; None: it runs them itself again.
        An open checkpoint region takes every command so (checkpoint_regions.RegionCommands)."""
        self.diverted = run

    @property
    def profiling(self) -> bool:
        """Whether dtorch.profile records each command now (handle_profile)."""
        return self.profiler is not None

    def handle(self, command) -> None:
        """The command's handler, and nothing around it: what it raises, raises."""
        self._handlers[type(command)](command)

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
            self.failed(command, error)
        finally:
            self.busy_seq, self._inputs = -1, ()
        return True

    def _execute(self, command) -> None:
        self.busy_seq = command.seq   # the heartbeat thread reports a command that runs too long
        try:
            with self.device.compute():
                self._handlers[type(command)](command)
        except Poisoned as poisoned:
            self.shards.poison(_outputs_of(command), poisoned.origin)
        except Exception as error:  # any failure of one command; the worker goes on
            self.failed(command, error)
        finally:
            self.busy_seq, self._inputs = -1, ()

    def failed(self, command, error: Exception) -> None:
        """The command raised `error`: its outputs are poisoned, the error reported under its seq."""
        self.shards.poison(_outputs_of(command), command.seq)
        self._report(command, error)

    def _report(self, command, error: Exception) -> None:
        op = getattr(command, "op", None) or getattr(command, "kind", None) or type(command).__name__
        report = wire.ErrorReport(command.seq, self.rank, op, type(error).__name__, str(error),
                                  "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.sockets.send([wire.encode(report)])

    # --- handlers: one per command ---------------------------------------------------------------
    def handle_define_mesh(self, command: wire.DefineMesh) -> None:
        self.shards.meshes[command.mesh_id] = DeviceMesh(command.device_type, nest_ranks(command.ranks, command.shape))

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

    def _localized_args(self, command: wire.RunOp, mesh: DeviceMesh):
        """Resolve tensors depth-first; run the fused moves, then slice the Replicate inputs the
        op needs as shards."""
        local_steps = {index: rest for index, *rest in command.input_steps}
        moved = self.moves.moved_inputs(command, mesh) if command.moves else {}
        numbering = itertools.count()

        def local(ref: TensorRef) -> torch.Tensor:
            index = next(numbering)
            tensor = moved[index] if index in moved else self._tensor(ref.id)
            if index in local_steps:
                shape, placements, steps = local_steps[index]
                # local steps (slices) communicate nothing, so a rank records one only for an input
                # that requires grad: torch refuses a grad-requiring weight where it has no derivative
                with torch.set_grad_enabled(tensor.requires_grad and torch.is_grad_enabled()):
                    tensor = apply_steps(tensor, shape, mesh, placements, steps, self.rank, self.comms.comm)
            return tensor
        place = self._place(mesh)
        return map_refs(command.args, local, place), map_refs(command.kwargs, local, place)

    def _place(self, mesh: DeviceMesh):
        """The rank-local value of a ShardRegion (where this rank's block sits: (offset, shape))
        or of a PeerGroup (this rank's peers along a mesh dim, over the communicator)."""
        def place(value):
            if type(value) is ShardRegion:
                return value.at(mesh, mesh.coordinate_of(self.rank))
            return Peers(value, mesh, self.rank, self.comms.comm)
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
        tensors = tuple([a for a in args if isinstance(a, torch.Tensor)])
        try:
            out, done = self.device.communicate(lambda: KERNELS[command.kernel](*args, **kwargs), tensors)
        except Exception:
            if failed is None:
                raise
        if failed is not None:   # even if the stand-in failed too: the input's failure comes first
            raise failed
        for tensor_id, tensor in zip(command.out_ids, out if isinstance(out, (tuple, list)) else (out,)):
            self.shards.keep(tensor_id, tensor, done)

    def handle_fetch(self, command: wire.Fetch) -> None:
        mesh = self._member(command.mesh_id)
        if mesh is None:
            return
        poisoned = self.shards.poisoned
        if command.tensor_id in poisoned:
            status, frames = ("poisoned", poisoned[command.tensor_id]), []
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
        self.shards.free(command.ids)

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
                self.profiler = CommandRecorder(self.comms, self.shards.poisoned)
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
        self.comms.regroup(command.generation, command.replaced)


_ON_COMMAND_SOCKET = (wire.Batch, wire.Private, wire.Probe)   # probes need no answer once registered


def handler_table(commands: tuple, owners: tuple) -> dict:
    """{command type: its handler}: for each of `commands`, the method named after it
    (protocol.handler_name) on the one of `owners` (the Worker and its components) that has it.
    A command none of them handles, or two do, is a mistake of the code: TypeError, naming them,
    when the worker starts (tests/test_lifecycle.py::test_every_command_has_a_handler)."""
    table, wrong = {}, []
    for command in commands:
        name = wire.handler_name(command)
        found = [owner for owner in owners if callable(getattr(owner, name, None))]
        if len(found) == 1:
            table[command] = getattr(found[0], name)
        else:
            where = " and ".join(type(owner).__name__ for owner in found) or "none of " + ", ".join(
                type(owner).__name__ for owner in owners)
            wrong.append(f"{command.__name__} ({name} on {where})")
    if wrong:
        raise TypeError("each command needs one handler, on the Worker or one of its components: " + "; ".join(wrong))
    return table


def _outputs_of(command) -> tuple:
    if hasattr(command, "out_ids"):
        return command.out_ids
    return (command.out_id,) if hasattr(command, "out_id") else ()


