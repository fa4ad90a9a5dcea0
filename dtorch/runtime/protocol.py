"""The wire protocol: the one module that knows how messages look on a socket.

Directions
  controller -> workers  PUB/SUB   [topic, Batch, body]               commands, batched
  controller -> worker   PUB/SUB   [topic R<rank>., Private, data..]  private upload bytes
  controller -> workers  PUB/SUB   [topic P, Probe]                   until every worker registered
  controller -> worker   ROUTER    [Welcome | Refused | Pong]
  worker -> controller   DEALER    [Register | Reply | ErrorReport | WarningReport | Heartbeat, data...]

Commands (DefineMesh ... Shutdown) are typed records that travel as rows of a Batch body; every
other message is a typed record of its own (Batch ... Pong), encoded by `encode` and read back by
`decode`, which checks each field's type. Every header is msgpack and starts with (VERSION, kind).
Tensor bytes travel as raw frames after the header, never inside msgpack, and nothing that arrives
from a socket is ever unpickled. docs/reference/protocol.md describes the same schema in prose; its version
and its tables of commands and messages (names, fields, handlers) are checked against this module by
tests/test_docs_match_code.py, so a new command or a version bump needs its row there.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple, cast

import msgpack
import torch

from ..spec.placements import Partial, PeerGroup, Placement, Replicate, Shard, ShardRegion
from ..errors import ProtocolError

__all__ = [
    "VERSION", "Kind", "HEARTBEAT_INTERVAL", "PROTOCOL_FAILURE", "TOPIC_ALL", "TOPIC_PROBE", "topic_for_rank",
    "lost_worker_key",
    # commands
    "DefineMesh", "Factory", "Upload", "LoadShard", "RunOp", "Redistribute", "Transfer", "Fetch", "Free", "Sync",
    "Shutdown", "Regroup", "RequireGrad", "SetGrads", "Backward", "OptimizerStep", "GradNorm", "UpdateGrads",
    "SaveShard", "LoadChunks", "Profile", "DefineGraph", "RunGraph", "DropGraph", "CheckpointBegin", "CheckpointEnd",
    "RECOMPUTED_IN_CHECKPOINT", "KEPT_IN_CHECKPOINT", "COMMANDS", "handler_name", "encode_batch", "decode_batch",
    "span", "decode_rows", "command_row",
    # every other message
    "Batch", "Private", "Probe", "Register", "Welcome", "Refused", "Reply", "ErrorReport", "WarningReport",
    "Heartbeat", "Pong", "MESSAGES", "FROM_WORKER", "REPLY_STATUSES", "encode", "decode", "decode_from_worker",
    "read_header",
    # values inside messages
    "TensorRef", "WireRef", "wire_ref", "pack", "unpack", "dtype_name", "dtype_from_name", "encode_placement",
    "decode_placement", "tensor_frame", "tensor_from_frame", "clip",
]

VERSION = 20   # 2: REGISTER carries the run's secret; 3: RunOp names the user's op and the kernel;
              # 4: LoadShard (each worker reads its block of a checkpoint tensor from a file);
              # 5: PeerGroup arguments (kernels that exchange blocks with their peers: ring attention);
              # 6: Regroup (lost ranks were replaced: communication groups of a new generation)
              # 7: autograd: RunOp and Redistribute say whether to record for backward; RequireGrad,
              #    SetGrads, Backward
              # 8: OptimizerStep, GradNorm, UpdateGrads (dtorch.optim, dtorch.nn.utils: in place on workers)
              # 9: SaveShard, LoadChunks (sharded checkpoints: each worker writes its own blocks,
              #    and reads back the parts of saved chunks that overlap its block)
              # 10: Profile (dtorch.profile: workers record their commands while on, answer with
              #     their clock, and send what they recorded when it turns off)
              # 11: DefineGraph, RunGraph, DropGraph (dtorch.compile: a captured command list,
              #     replayed by one command that spans one seq per captured command)
              # 12: Backward.buckets (data-parallel gradients all-reduced during the backward)
              # 13: WarningReport (a Python warning a command raised on a worker, shown once by the
              #     controller at the user's line instead of printed by every rank)
              # 14: RunOp.moves (the redistributes the planner inserted before an op, fused into it)
              # 15: RunOp.regather (whether a gathered parameter may be gathered again in backward)
              # 16: CheckpointBegin, CheckpointEnd (activation checkpointing: the commands between
              #     them save nothing for backward, which runs them again)
              # 17: LoadChunks' chunk rows end with the chunk's crc32 (-1: none to check)
              # 18: RunGraph.hypers (an optimizer row's hyperparameters now: an lr schedule replays),
              #     DefineGraph.scalars and RunGraph.scalars (numbers passed to a compiled function)
              # 19: Register carries the worker's torch intra-op thread count (dtorch.workers() shows it)
              # 20: DefineGraph.backend ("inductor": each run of plain rows is compiled by torch's
              #     inductor on the workers: dtorch.compile(fn, backend="inductor"))

TOPIC_ALL = b"A"
TOPIC_PROBE = b"P"


def topic_for_rank(rank: int) -> bytes:
    # The trailing dot stops SUB prefix matching: "R1." is not a prefix of "R10.".
    return b"R%d." % rank


class Kind(enum.IntEnum):
    BATCH = 1        # PUB: a run of commands, seq first..first+count-1
    PRIVATE = 2      # PUB to one rank: raw bytes that one command of a batch will consume
    PROBE = 3        # PUB: "are you subscribed yet?" answered by REGISTER
    REGISTER = 10    # worker -> controller: rank, host, pid, device, the run's secret, threads
    WELCOME = 11     # controller -> worker: first seq to execute and rendezvous address
    REPLY = 12       # worker -> controller: answer to Fetch / Sync, with data frames
    ERROR = 13       # worker -> controller: a command raised; tagged with its seq
    HEARTBEAT = 14   # worker -> controller, every HEARTBEAT_INTERVAL
    PONG = 15        # controller -> worker, answers a heartbeat
    REFUSED = 16     # controller -> worker: registration rejected, with the reason
    WARNING = 17     # worker -> controller: a command raised a Python warning; tagged with its seq


HEARTBEAT_INTERVAL = 0.5
# The op name of an ERROR meaning "this worker's command stream broke; it is unusable".
PROTOCOL_FAILURE = "<protocol>"


def lost_worker_key(rank: int) -> str:
    """The rendezvous-store key the controller sets when worker `rank` is lost (NCCL peers
    watch it so that no collective waits for a dead peer)."""
    return f"dtorch/lost/{rank}"


# --- commands: one small record each, (seq, ...) ------------------------------------------------
class DefineMesh(NamedTuple):
    seq: int
    mesh_id: int
    device_type: str
    shape: tuple
    ranks: tuple


class Factory(NamedTuple):
    seq: int
    out_id: int
    mesh_id: int
    kind: str            # zeros, ones, full, empty, arange, rand, randn, randint, ...
    shape: tuple
    dtype: str
    placements: tuple
    args: tuple


class Upload(NamedTuple):
    seq: int
    out_id: int
    mesh_id: int
    shape: tuple
    dtype: str
    placements: tuple


class LoadShard(NamedTuple):
    seq: int
    out_id: int
    mesh_id: int
    shape: tuple         # global shape, the same in the file and in dtorch
    dtype: str           # the tensor's dtype in dtorch: the stored bytes are cast to it
    placements: tuple    # each rank reads only its own block; P(sum): one rank per group reads
    path: str            # the file, as every worker's host names it
    name: str            # the tensor's name in the file, for errors
    data_offset: int     # where its bytes start in the file: row-major, little-endian
    stored_dtype: str    # the dtype of those bytes


class RunOp(NamedTuple):
    seq: int
    out_ids: tuple
    mesh_id: int
    op: str              # the op the user called (reshape), named in errors
    kernel: str          # what the worker runs (reshape_local): the rule's choice
    args: tuple          # tensors appear as ExtType TENSOR references
    kwargs: dict
    input_steps: tuple   # ((tensor_index, shape, placements, steps), ...): local slicing first
    grad: bool = False   # record it for backward (grad mode on and an input requires grad)
    moves: tuple = ()    # ((tensor_index, shape, dtype, placements, steps, grad), ...): the planner's
                         # inserted redistributes, run before input_steps, on the communication stream
    regather: bool = True   # with grad: a gathered parameter among the inputs may be saved as the way to
                            # gather it again (a collective in backward); False where some rank holds an
                            # empty piece of an input or output, whose kernel may save nothing


class Redistribute(NamedTuple):
    seq: int
    out_id: int
    src_id: int
    mesh_id: int
    shape: tuple         # global shape: nested uneven shards need it to size each step
    dtype: str           # a rank whose input failed joins the collectives with zeros of it
    placements: tuple    # placements before the first step
    steps: tuple         # ((mesh_dim, before, after), ...) from dtorch.spec.redistribute
    grad: bool = False   # record it for backward: each collective step gets its dual in backward
    donate: bool = False  # the source is a temporary nothing else reads: a P -> R may reduce in place


class Transfer(NamedTuple):
    seq: int
    out_id: int
    src_id: int
    src_mesh_id: int
    dst_mesh_id: int
    shape: tuple
    dtype: str
    src_placements: tuple   # no Partial: the controller reduces first
    dst_placements: tuple   # no Partial: the controller re-partializes after, locally


class Fetch(NamedTuple):
    seq: int
    tensor_id: int
    mesh_id: int
    senders: tuple       # ranks that send bytes; every other rank of the mesh sends status only


class Free(NamedTuple):
    seq: int
    ids: tuple


class Sync(NamedTuple):
    seq: int


class Shutdown(NamedTuple):
    seq: int


class Regroup(NamedTuple):
    seq: int
    generation: int      # groups created from here on are named with it, so none reuses an old one
    replaced: tuple      # ranks now run by new processes: cached groups holding them are dropped


class RequireGrad(NamedTuple):
    seq: int
    ids: tuple           # leaf tensors (factories, parameters, landed transfers)
    flag: bool           # requires_grad_(flag)


class SetGrads(NamedTuple):
    seq: int
    leaf_ids: tuple      # leaf tensors whose .grad is (re)bound on the workers
    grad_ids: tuple      # the tensor each one accumulates into from now on; -1: none (zero_grad)


class Backward(NamedTuple):
    seq: int
    mesh_id: int         # the ranks that take part: every rank whose graph holds the roots
    roots: tuple         # tensors to differentiate
    seeds: tuple         # their gradients, already in each root's gradient placements
    inputs: tuple        # leaves whose .grad is bound to out_ids ("backward"), or tensors whose
    out_ids: tuple       #   gradient becomes out_ids without accumulating ("grad")
    mode: str            # "backward" | "grad"
    retain_graph: bool
    buckets: tuple = ()  # ((mesh dims, (input index, ...)), ...): leaves whose gradients this rank
                         #   all-reduces over the group along those dims, bucket by bucket in this
                         #   order, while the backward runs (runtime/worker/grad_buckets.py)


class OptimizerStep(NamedTuple):
    """One optimizer step of one param group on one mesh: torch.optim's functional update over
    the local shards, IN PLACE (a parameter is an autograd leaf on the workers: same tensor, same id)."""
    seq: int
    mesh_id: int
    kind: str            # a torch.optim class name (optim_kernels.STATE_NAMES): the update the workers run
    hyper: dict          # the group's hyperparameters (lr, momentum, betas, ...) as plain numbers
    param_ids: tuple     # updated in place
    grad_ids: tuple      # one per param, with its placements
    state_ids: tuple     # per param, its buffers in the kind's order (optim_kernels.STATE_NAMES), flattened
    steps: tuple         # per param, its step count before this step (Adam's bias correction)
    fresh: tuple         # per param, 1 where this step makes its buffers (torch's lazy state), else 0

    @property
    def out_ids(self) -> tuple:
        """Every tensor the step writes: on a failure all of them are poisoned, never half-updated."""
        return self.param_ids + self.state_ids


class GradNorm(NamedTuple):
    """This rank's share of the norm of many gradients, as one 0-d tensor placed P(sum) (finite
    norm_type: the sum of |g|^p) or P(max) / P(min) (+inf / -inf) on every mesh dim."""
    seq: int
    out_id: int
    mesh_id: int
    norm_type: float
    grad_ids: tuple
    placements: tuple    # per gradient, its placements: a Replicate copy counts on one rank only


class UpdateGrads(NamedTuple):
    """Gradients changed in place: scaled by a 0-d tensor (clip_grad_norm_), clamped to
    [-bound, bound] (clip_grad_value_) or zeroed (zero_grad(set_to_none=False))."""
    seq: int
    mesh_id: int
    kind: str            # clip_grad_norm_ (scale), clip_grad_value_ (clamp), zero_grad
    grad_ids: tuple
    factor_id: int       # clip_grad_norm_: the 0-d Replicate factor; -1 otherwise
    bound: float         # clip_grad_value_: the bound; 0.0 otherwise

    @property
    def out_ids(self) -> tuple:
        return self.grad_ids


class SaveShard(NamedTuple):
    seq: int
    directory: str       # where every writing rank puts its file, as every worker's host names it
    file_index: int      # one file per writing rank per SaveShard: runtime.file_shards.shard_file_name
    writes: tuple        # ((rank, tensor_id, name), ...): each rank writes its whole local block of
                         # the tensors naming it, under `name`; replicas are named once, by the controller


class LoadChunks(NamedTuple):
    seq: int
    out_id: int
    mesh_id: int
    shape: tuple         # global shape
    dtype: str           # the tensor's dtype in dtorch: the stored bytes are cast to it
    placements: tuple    # each rank reads the parts of the chunks that overlap its own block
    chunks: tuple        # ((path, data_offset, stored_dtype, offset, shape, crc32), ...): blocks tiling the
                         # tensor; crc32 -1: not checked (none recorded, or load(verify=False))
    name: str            # the tensor's key, for errors


class Profile(NamedTuple):
    """dtorch.profile: every live worker answers with a Reply whose one data frame is
    pack([clock_ns]) (on) or pack([clock_ns, rows]) (off; rows: runtime/worker/profiling.py)."""
    seq: int
    on: bool             # True: record every command after this one (again while on: a clock
                         # ping, recording goes on); False: stop, and send what was recorded


class DefineGraph(NamedTuple):
    """dtorch.compile: the commands one call of a function issued, kept by every worker under
    `graph_id` and run again by RunGraph. The rows are (opcode, seq, *fields) as in a batch; ids
    inside them are the capture's own: RunGraph binds the capture's inputs to its arguments."""
    seq: int
    graph_id: int
    rows: tuple
    inputs: tuple        # the capture's input ids, in argument order
    outputs: tuple       # the capture's output ids, moved to RunGraph's out_ids after a replay
    scratch: tuple       # ids made and dropped inside the call: freed after every replay
    random: tuple        # indexes of rows that drew from the global random stream (counter + shift)
    steps: tuple         # indexes of OptimizerStep rows (each param's step count + its shift)
    scalars: tuple = ()  # ((row index, argument index, k), ...): RunOp operands that take
                         #   RunGraph.scalars[k] (dtorch.compile(fn, scalars=...))
    backend: str = ""    # "" replays the rows; "inductor" compiles each run of plain rows with
                         #   torch's inductor (dtorch.compile(fn, backend="inductor"))


class RunGraph(NamedTuple):
    """Replay graph `graph_id`. It spans `span` seqs: row i runs as command seq + i, so a failure
    names the captured command, and seq-keyed state (a backward's store keys) stays unique."""
    seq: int
    graph_id: int
    span: int            # the number of rows
    input_ids: tuple
    out_ids: tuple
    seed: int            # the global random stream's seed now
    random_shift: int    # its counter now minus its counter at capture
    step_shifts: tuple   # per OptimizerStep row: the step count now minus at capture
    defined_seq: int     # the DefineGraph's seq: a worker that joined after it is on none of its meshes
    hypers: tuple = ()   # per OptimizerStep row, the hyperparameters that differ from the row's
                         #   ({"lr": 0.002}: an lr scheduler's); () where none differ in any row
    scalars: tuple = ()  # the numbers for DefineGraph.scalars, in the order of its k


class DropGraph(NamedTuple):
    seq: int
    graph_id: int


class CheckpointBegin(NamedTuple):
    """dtorch.utils.checkpoint: the RunOps and Redistributes from here to the matching
    CheckpointEnd run without recording for backward, and backward runs them again from the
    tensors they read from before (runtime/worker/checkpoint_regions.py). Regions nest: an inner pair
    belongs to the outer region."""
    seq: int


class CheckpointEnd(NamedTuple):
    """The region's tensors still held here (the controller freed the rest first) become the
    outputs of one autograd node, whose backward recomputes the region."""
    seq: int


# What a checkpoint region may hold (runtime/worker/checkpoint_regions.py): ops and redistributes, run
# again in backward; what makes or reads tensors as it would outside (a factory's, an upload's
# output is an input of the region); frees, fences and flags. Anything else (a backward, an
# optimizer step, a move to another mesh, a replay) is refused by the controller at the user's
# line (frontend_state.refuse_inside_checkpoint), and by a worker that meets one anyway. RequireGrad and
# SetGrads come with an in-place change of a parameter under no_grad (its new id made a leaf, its
# .grad bound to it).
RECOMPUTED_IN_CHECKPOINT = (RunOp, Redistribute)
KEPT_IN_CHECKPOINT = (DefineMesh, Factory, Upload, Fetch, Free, Sync, RequireGrad, SetGrads, Shutdown, DropGraph,
                      CheckpointBegin, CheckpointEnd)

COMMANDS = (DefineMesh, Factory, Upload, LoadShard, RunOp, Redistribute, Transfer, Fetch, Free, Sync, Shutdown,
            Regroup, RequireGrad, SetGrads, Backward, OptimizerStep, GradNorm, UpdateGrads, SaveShard, LoadChunks,
            Profile, DefineGraph, RunGraph, DropGraph, CheckpointBegin, CheckpointEnd)
OPCODE = {cls: i for i, cls in enumerate(COMMANDS)}
_BY_OPCODE = dict(enumerate(COMMANDS))


def handler_name(record_type, prefix: str = "handle_") -> str:
    """Each side dispatches a record to a method named after it: a worker's RunOp goes to
    handle_run_op, the controller's Reply to _on_reply."""
    name = record_type.__name__
    return prefix + "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


# --- values inside commands ----------------------------------------------------------------------
EXT_TENSOR, EXT_DTYPE, EXT_SLICE, EXT_ELLIPSIS, EXT_PLACEMENT, EXT_REGION, EXT_PEERS = 1, 2, 3, 4, 5, 6, 7
_ID = struct.Struct("<q")


class TensorRef:
    """A tensor argument by id, as workers decode it; the worker substitutes its local shard.
    (Not a tuple: msgpack would pack a tuple subclass as a plain array before asking `_default`.)"""
    __slots__ = ("id",)

    def __init__(self, tensor_id: int):
        self.id = tensor_id

    def __eq__(self, other) -> bool:
        return type(other) is TensorRef and other.id == self.id

    def __hash__(self) -> int:
        return hash(("TensorRef", self.id))

    def __repr__(self) -> str:
        return f"TensorRef({self.id})"


class WireRef(msgpack.ExtType):
    """The controller's tensor reference: already the msgpack extension it goes on the wire as,
    so the packer writes it in C instead of calling `_default` per tensor (0.6 us of the ~1.2 us
    a small RunOp took to encode). Workers decode the same bytes as a TensorRef."""
    __slots__ = ()

    @property
    def id(self) -> int:
        return _ID.unpack(self.data)[0]

    def __repr__(self) -> str:
        return f"TensorRef({self.id})"


_new_tuple, _pack_id = tuple.__new__, _ID.pack


def wire_ref(tensor_id: int) -> WireRef:
    """A WireRef, built without ExtType's Python-level argument checks (the hot path: every
    tensor input of every op)."""
    return _new_tuple(WireRef, (EXT_TENSOR, _pack_id(tensor_id)))


def _default(value: Any):
    if isinstance(value, TensorRef):
        return msgpack.ExtType(EXT_TENSOR, _ID.pack(value.id))
    if isinstance(value, torch.dtype):
        return msgpack.ExtType(EXT_DTYPE, dtype_name(value).encode())
    if isinstance(value, slice):
        return msgpack.ExtType(EXT_SLICE, msgpack.packb((value.start, value.stop, value.step)))
    if value is Ellipsis:
        return msgpack.ExtType(EXT_ELLIPSIS, b"")
    if isinstance(value, Placement):
        return msgpack.ExtType(EXT_PLACEMENT, struct.pack("b", encode_placement(value)))
    if isinstance(value, torch.Size):
        return list(value)
    if type(value) is ShardRegion:
        return msgpack.ExtType(EXT_REGION, msgpack.packb(_region_fields(value)))
    if type(value) is PeerGroup:
        return msgpack.ExtType(EXT_PEERS, msgpack.packb((value.mesh_dim, [_region_fields(r) for r in value.layouts])))
    raise ProtocolError(f"cannot put {type(value).__name__} on the wire: {value!r}")


def _region_fields(region: ShardRegion) -> tuple:
    return region.shape, [encode_placement(p) for p in region.placements]


def _region(shape, codes) -> ShardRegion:
    return ShardRegion(shape, [decode_placement(c) for c in codes])


def _ext_hook(code: int, data: bytes):
    if code == EXT_TENSOR:  # by far the most frequent: first, and without struct
        return TensorRef(int.from_bytes(data, "little", signed=True))
    if code == EXT_DTYPE:
        return dtype_from_name(data.decode())
    if code == EXT_SLICE:
        return slice(*msgpack.unpackb(data))
    if code == EXT_ELLIPSIS:
        return Ellipsis
    if code == EXT_PLACEMENT:
        return decode_placement(struct.unpack("b", data)[0])
    if code == EXT_REGION:
        return _region(*msgpack.unpackb(data))
    if code == EXT_PEERS:
        mesh_dim, layouts = msgpack.unpackb(data)
        return PeerGroup(mesh_dim, [_region(*fields) for fields in layouts])
    raise ProtocolError(f"unknown msgpack extension type {code}")


_packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False, raw=False, strict_map_key=False)


# --- dtypes and placements ----------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r} on the wire") from None


_PARTIAL_CODES = {"sum": -2, "avg": -3, "max": -4, "min": -5}
_PARTIAL_BY_CODE = {code: Partial(op) for op, code in _PARTIAL_CODES.items()}
_SHARDS = [Shard(d) for d in range(64)]
_REPLICATE = Replicate()


def encode_placement(placement: Placement) -> int:
    if isinstance(placement, Shard):
        return placement.dim
    if isinstance(placement, Replicate):
        return -1
    return _PARTIAL_CODES[cast(Partial, placement).reduce_op]


def decode_placement(code: int) -> Placement:
    if code >= 0:
        return _SHARDS[code]
    if code == -1:
        return _REPLICATE
    return _PARTIAL_BY_CODE[code]


# --- whole messages ------------------------------------------------------------------------------
def encode_batch(first_seq: int, commands: list) -> list[bytes]:
    """A batch: commands go as [opcode, *fields] rows in one msgpack body."""
    header = encode(Batch(first_seq, len(commands)))
    body = _packer.pack([(OPCODE[type(c)],) + tuple(c) for c in commands])   # command_row, inline: per command
    return [TOPIC_ALL, header, body]


# The Python functions that hand values to msgpack's C packer. Its packer compares an int
# subclass with 0 (`o > 0`) to pick the encoding, so a number that watches its own uses (a
# marked argument of dtorch.compile: dtensor/compile_scalars.py) sees that call come from one of
# these: this module's batches, and msgpack's own packb (pack, and the extension types' fields).
PACKING_CODE = frozenset([code for code in (encode_batch.__code__, getattr(msgpack.packb, "__code__", None))
                          if code is not None])


def command_row(command) -> tuple:
    """A command as a batch row (opcode, seq, *fields); DefineGraph carries rows like it."""
    return (OPCODE[type(command)],) + tuple(command)


# The type of each command field after seq, checked on decode so that a handler never meets a
# value of the wrong kind (its *values* are the handler's to check: a failure there is reported
# as that command's error). IDS: a tuple of ints.
IDS = "ids"
NUMBER = (int, float)
_FIELD_TYPES = {
    DefineMesh: (int, str, tuple, IDS), Factory: (int, int, str, tuple, str, tuple, tuple),
    Upload: (int, int, tuple, str, tuple), LoadShard: (int, int, tuple, str, tuple, str, str, int, str),
    RunOp: (IDS, int, str, str, tuple, dict, tuple, bool, tuple, bool),
    Redistribute: (int, int, int, tuple, str, tuple, tuple, bool, bool),
    Transfer: (int, int, int, int, tuple, str, tuple, tuple), Fetch: (int, int, IDS),
    Free: (IDS,), Sync: (), Shutdown: (), Regroup: (int, IDS),
    RequireGrad: (IDS, bool), SetGrads: (IDS, IDS), Backward: (int, IDS, IDS, IDS, IDS, str, bool, tuple),
    OptimizerStep: (int, str, dict, IDS, IDS, IDS, IDS, IDS), GradNorm: (int, int, NUMBER, IDS, tuple),
    UpdateGrads: (int, str, IDS, int, NUMBER),
    SaveShard: (str, int, tuple), LoadChunks: (int, int, tuple, str, tuple, tuple, str),
    Profile: (bool,),
    DefineGraph: (int, tuple, IDS, IDS, IDS, IDS, IDS, tuple, str),
    RunGraph: (int, int, IDS, IDS, int, int, IDS, int, tuple, tuple),
    DropGraph: (int,), CheckpointBegin: (), CheckpointEnd: (),
}


def decode_batch(batch: Batch, body) -> list:
    """The commands of a batch; ProtocolError for anything malformed."""
    first_seq, count = batch
    if count < 0:
        raise ProtocolError(f"malformed batch header {clip(batch)}")
    try:
        rows = unpack(body)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises several types; all mean "not ours"
        raise ProtocolError(f"undecodable batch body ({clip(error)})") from None
    if type(rows) is not tuple or len(rows) != count:
        raise ProtocolError(f"batch header says {count} commands, body holds {clip(rows)[:60]}")
    commands, seq = [], first_seq
    for row in rows:
        commands.append(_command(seq, row))
        seq += span(commands[-1])
    return commands


def span(command) -> int:
    """How many seqs a command takes: one, or one per replayed row for RunGraph."""
    return command.span if type(command) is RunGraph else 1


def decode_rows(rows) -> list:
    """A DefineGraph's rows as commands, each checked like a batch's (its own seq inside)."""
    if type(rows) is not tuple or not all(type(r) is tuple and len(r) > 1 and type(r[1]) is int for r in rows):
        raise ProtocolError(f"malformed graph rows {clip(rows)}")
    commands = [_command(row[1], row) for row in rows]
    if any(type(c) in (DefineGraph, RunGraph, DropGraph) for c in commands):
        raise ProtocolError("a graph's rows hold a graph command")
    return commands


def _command(seq: int, row):
    command_type = _BY_OPCODE.get(row[0]) if type(row) is tuple and row and type(row[0]) is int else None
    if command_type is None:
        raise ProtocolError(f"command #{seq}: not a command row {clip(row)}")
    values = row[1:]
    exact, ids_at = _EXACT_TYPES[command_type]
    # Every worker decodes every command: the common case is one comparison made in C (0.95 us
    # a RunOp, with decoding), and anything else takes the field-by-field check (2.0 us). A list:
    # tuple(map(...)) would be built by resizing a 10-slot tuple (tests/test_soak.py says why not).
    if [*map(type, values)] == exact:
        for i in ids_at:
            if not _INTS.issuperset(map(type, values[i])):
                _check_fields(seq, command_type, values)   # raises
        command: tuple = _new_tuple(command_type, values)   # every field present: no defaults to fill
    else:
        _check_fields(seq, command_type, values)
        command = command_type(*values)
    if values[0] != seq:
        raise ProtocolError(f"command #{seq}: numbered #{values[0]}")
    return command


def _check_fields(seq: int, command_type, values: tuple) -> None:
    types = (int,) + _FIELD_TYPES[command_type]
    # trailing fields with a default may be absent (added later without a version bump: donate)
    if len(types) - len(command_type._field_defaults) <= len(values) < len(types):
        types = types[:len(values)]
    if len(values) != len(types) or not all(_has_type(v, t) for v, t in zip(values, types)):
        raise ProtocolError(f"command #{seq}: malformed {command_type.__name__} {clip(values)}")


def _exact_types(field_types: tuple) -> tuple:
    """(the type of every field when none is a NUMBER nor left out, as a list; the positions of
    IDS fields)."""
    types = (int,) + field_types
    exact = [tuple if t is IDS else t if type(t) is type else None for t in types]
    return exact, tuple([i for i, t in enumerate(types) if t is IDS])


_INTS = frozenset({int})
_EXACT_TYPES = {command_type: _exact_types(types) for command_type, types in _FIELD_TYPES.items()}


def _has_type(value, expected) -> bool:
    if expected is IDS:
        return type(value) is tuple and all(type(v) is int for v in value)
    if type(expected) is tuple:
        return type(value) in expected
    return type(value) is expected


# --- every other message: one typed record per kind ---------------------------------------------
# On the wire a message is its header alone, [VERSION, kind, *fields], then raw data frames.
class Batch(NamedTuple):        # controller -> workers (PUB); the body frame holds the commands
    first_seq: int
    count: int   # type: ignore[assignment]  # a field named like tuple.count, which it hides on purpose


class Private(NamedTuple):      # controller -> one worker (PUB topic R<rank>.); data frames follow
    seq: int                    # the command that will consume the bytes


class Probe(NamedTuple):        # controller -> workers (PUB): "are you subscribed yet?"
    pass


class Register(NamedTuple):     # worker -> controller, once, after it has heard a Probe
    rank: int
    host: str
    pid: int
    device: str
    secret: str                 # the run's secret, which the worker read on its stdin
    threads: int                # torch.get_num_threads() once the worker set it (dtorch.workers() shows it)


class Welcome(NamedTuple):      # controller -> worker: registration accepted
    first_seq: int              # the first command this worker executes
    store_address: str          # the rendezvous store for collectives
    gloo_timeout_s: float


class Refused(NamedTuple):      # controller -> worker: registration rejected
    reason: str


class Reply(NamedTuple):        # worker -> controller: answers a Fetch or Sync; bytes may follow
    seq: int
    rank: int
    status: str                 # one of REPLY_STATUSES
    origin_seq: int             # poisoned: the command that failed first; otherwise -1


class ErrorReport(NamedTuple):  # worker -> controller: a command raised
    seq: int
    rank: int
    op: str                     # the op the user called (PROTOCOL_FAILURE: the stream broke)
    exception_type: str
    message: str
    traceback: str


class WarningReport(NamedTuple):  # worker -> controller: a command raised a Python warning
    seq: int
    rank: int
    category: str               # the warning's class name (UserWarning, RuntimeWarning, ...)
    message: str


class Heartbeat(NamedTuple):    # worker -> controller, every HEARTBEAT_INTERVAL, own socket
    rank: int
    live_tensors: int           # tensors the worker holds now (dtorch.workers() shows it)
    rss_bytes: int              # the worker process's resident memory (0 where unknown)
    busy_seq: int               # the command its main thread is running now; -1 when idle
    busy_s: float               # for how long it has run that command (heartbeat resolution)


class Pong(NamedTuple):         # controller -> worker: answers a Heartbeat
    pass


REPLY_STATUSES = ("ok", "poisoned", "missing")
MESSAGES = {Batch: Kind.BATCH, Private: Kind.PRIVATE, Probe: Kind.PROBE, Register: Kind.REGISTER,
            Welcome: Kind.WELCOME, Refused: Kind.REFUSED, Reply: Kind.REPLY, ErrorReport: Kind.ERROR,
            WarningReport: Kind.WARNING, Heartbeat: Kind.HEARTBEAT, Pong: Kind.PONG}
_MESSAGE_BY_KIND = {int(kind): message_type for message_type, kind in MESSAGES.items()}
# The type of each field, checked on decode before anything looks at a value (bool is not an int).
_MESSAGE_FIELDS = {
    Batch: (int, int), Private: (int,), Probe: (), Register: (int, str, int, str, str, int),
    Welcome: (int, str, NUMBER), Refused: (str,), Reply: (int, int, str, int),
    ErrorReport: (int, int, str, str, str, str), WarningReport: (int, int, str, str),
    Heartbeat: (int, int, int, int, NUMBER), Pong: (),
}
# What workers may send the controller, and how many data frames may follow each header.
FROM_WORKER = {Register: 0, Reply: 1, ErrorReport: 0, WarningReport: 0, Heartbeat: 0}


def encode(message) -> bytes:
    """The header frame of a typed message."""
    return pack((VERSION, int(MESSAGES[type(message)])) + tuple(message))


def decode(frame, expected) -> tuple:
    """The typed message in a header frame, if it is one of the `expected` types and each field
    has its type; ProtocolError naming what is wrong otherwise."""
    fields = read_header(frame)
    kind = fields[1]
    message_type = _MESSAGE_BY_KIND.get(kind) if type(kind) is int else None
    if message_type is None or message_type not in expected:
        raise ProtocolError(f"unexpected message kind {clip(kind)}")
    values = fields[2:]
    types = _MESSAGE_FIELDS[message_type]
    if len(values) != len(types) or not all(_has_type(v, t) for v, t in zip(values, types)):
        raise ProtocolError(f"malformed {message_type.__name__}: {clip(values)}")
    return message_type(*values)


def decode_from_worker(header: bytes | None, data: list):
    """The message a worker sent the controller (its header; `data`, the frames after it, only
    counted here); ProtocolError if malformed."""
    if header is None:
        raise ProtocolError("a message without a header")
    message = decode(header, FROM_WORKER)
    if len(data) > FROM_WORKER[type(message)]:
        raise ProtocolError(f"{type(message).__name__} with {len(data)} data frames")
    return message


def clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def read_header(frame) -> tuple:
    """Decode and check a header frame; raises ProtocolError with the reason when malformed."""
    try:
        fields = unpack(frame)
    except Exception as error:  # msgpack raises several types; all mean "not ours"
        raise ProtocolError(f"undecodable header ({error})") from None
    if not isinstance(fields, tuple) or len(fields) < 2:
        raise ProtocolError(f"malformed header {clip(fields)}")
    if fields[0] != VERSION:
        raise ProtocolError(f"protocol version {clip(fields[0])} does not match this side's {VERSION}")
    return fields


# --- tensor bytes --------------------------------------------------------------------------------
def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """Zero-copy view of a CPU tensor's bytes (bfloat16 included, which numpy lacks)."""
    flat = tensor.detach().contiguous().reshape(-1)
    # contiguous() keeps any stride on a 0- or 1-element tensor; view(uint8) needs stride 1
    flat = flat.as_strided((flat.numel(),), (1,))
    # numpy declares ndarray's buffer protocol to type checkers only for Python 3.12 and later
    return memoryview(flat.view(torch.uint8).numpy())   # type: ignore[arg-type]


def tensor_from_frame(buffer, dtype: torch.dtype, shape) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.frombuffer(bytearray(buffer) if isinstance(buffer, bytes) else buffer, dtype=torch.uint8)
    if raw.data_ptr() % min(dtype.itemsize, 16):   # a frame ZeroMQ placed off the dtype's alignment:
        raw = raw.clone()                           # complex128 kernels crash on such a view
    return raw.view(dtype).reshape(tuple(shape))
