"""The wire protocol: the one module that knows how messages look on a socket.

Directions
  controller -> workers  PUB/SUB   [topic, header, body]            commands, batched
  controller -> worker   PUB/SUB   [topic R<rank>., header, data..] private upload bytes
  controller -> worker   ROUTER    [header]                          WELCOME, PONG
  worker -> controller   DEALER    [header, data...]                 REGISTER, REPLY, ERROR, HEARTBEAT

Every header is msgpack and starts with (VERSION, kind). Tensor bytes travel as raw frames after
the header, never inside msgpack, and nothing that arrives from a socket is ever unpickled.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple

import msgpack
import torch

from ..distributed_spec import Partial, Placement, Replicate, Shard
from ..errors import ProtocolError

VERSION = 2   # 2: REGISTER carries the run's secret

TOPIC_ALL = b"A"
TOPIC_PROBE = b"P"


def topic_for_rank(rank: int) -> bytes:
    # The trailing dot stops SUB prefix matching: "R1." is not a prefix of "R10.".
    return b"R%d." % rank


class Kind(enum.IntEnum):
    BATCH = 1        # PUB: a run of commands, seq first..first+count-1
    PRIVATE = 2      # PUB to one rank: raw bytes that one command of a batch will consume
    PROBE = 3        # PUB: "are you subscribed yet?" answered by REGISTER
    REGISTER = 10    # worker -> controller: rank, host, pid, device, the run's secret
    WELCOME = 11     # controller -> worker: first seq to execute and rendezvous address
    REPLY = 12       # worker -> controller: answer to Fetch / Sync, with data frames
    ERROR = 13       # worker -> controller: a command raised; tagged with its seq
    HEARTBEAT = 14   # worker -> controller, every HEARTBEAT_INTERVAL
    PONG = 15        # controller -> worker, answers a heartbeat
    REFUSED = 16     # controller -> worker: registration rejected, with the reason


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


class RunOp(NamedTuple):
    seq: int
    out_ids: tuple
    mesh_id: int
    op: str
    args: tuple          # tensors appear as ExtType TENSOR references
    kwargs: dict
    input_steps: tuple   # ((tensor_index, shape, placements, steps), ...): local slicing first


class Redistribute(NamedTuple):
    seq: int
    out_id: int
    src_id: int
    mesh_id: int
    shape: tuple         # global shape: nested uneven shards need it to size each step
    dtype: str           # a rank whose input failed joins the collectives with zeros of it
    placements: tuple    # placements before the first step
    steps: tuple         # ((mesh_dim, before, after), ...) from dtorch.redistribute


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


COMMANDS = (DefineMesh, Factory, Upload, RunOp, Redistribute, Transfer, Fetch, Free, Sync, Shutdown)
OPCODE = {cls: i for i, cls in enumerate(COMMANDS)}
_BY_OPCODE = dict(enumerate(COMMANDS))


def handler_name(command_type) -> str:
    """Workers dispatch a command to a method named after it: RunOp -> handle_run_op."""
    name = command_type.__name__
    return "handle_" + "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


# --- values inside commands ----------------------------------------------------------------------
EXT_TENSOR, EXT_DTYPE, EXT_SLICE, EXT_ELLIPSIS, EXT_PLACEMENT = 1, 2, 3, 4, 5
_ID = struct.Struct("<q")


class TensorRef:
    """A tensor argument by id; the worker substitutes its local shard. (Not a tuple: msgpack
    would pack a tuple subclass as a plain array before asking `_default`.)"""
    __slots__ = ("id",)

    def __init__(self, tensor_id: int):
        self.id = tensor_id

    def __eq__(self, other) -> bool:
        return type(other) is TensorRef and other.id == self.id

    def __hash__(self) -> int:
        return hash(("TensorRef", self.id))

    def __repr__(self) -> str:
        return f"TensorRef({self.id})"


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
    raise ProtocolError(f"cannot put {type(value).__name__} on the wire: {value!r}")


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
    return _PARTIAL_CODES[placement.reduce_op]


def decode_placement(code: int) -> Placement:
    if code >= 0:
        return _SHARDS[code]
    if code == -1:
        return _REPLICATE
    return _PARTIAL_BY_CODE[code]


# --- whole messages ------------------------------------------------------------------------------
def encode_batch(first_seq: int, commands: list) -> list[bytes]:
    """A batch: commands go as [opcode, *fields] rows in one msgpack body."""
    header = pack((VERSION, Kind.BATCH, first_seq, len(commands)))
    body = _packer.pack([(OPCODE[type(c)],) + tuple(c) for c in commands])
    return [TOPIC_ALL, header, body]


# The type of each command field after seq, checked on decode so that a handler never meets a
# value of the wrong kind (its *values* are the handler's to check: a failure there is reported
# as that command's error). IDS: a tuple of ints.
IDS = "ids"
_FIELD_TYPES = {
    DefineMesh: (int, str, tuple, IDS), Factory: (int, int, str, tuple, str, tuple, tuple),
    Upload: (int, int, tuple, str, tuple), RunOp: (IDS, int, str, tuple, dict, tuple),
    Redistribute: (int, int, int, tuple, str, tuple, tuple),
    Transfer: (int, int, int, int, tuple, str, tuple, tuple), Fetch: (int, int, IDS),
    Free: (IDS,), Sync: (), Shutdown: (),
}


def decode_batch(header: tuple, body) -> tuple[int, list]:
    """(first_seq, commands) of a BATCH; ProtocolError for anything malformed."""
    if len(header) != 4 or not all(type(v) is int for v in header[2:]) or header[3] < 0:
        raise ProtocolError(f"malformed batch header {clip(header)}")
    _, _, first_seq, count = header
    try:
        rows = unpack(body)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises several types; all mean "not ours"
        raise ProtocolError(f"undecodable batch body ({clip(error)})") from None
    if type(rows) is not tuple or len(rows) != count:
        raise ProtocolError(f"batch header says {count} commands, body holds {clip(rows)[:60]}")
    return first_seq, [_command(first_seq + i, row) for i, row in enumerate(rows)]


def _command(seq: int, row):
    command_type = _BY_OPCODE.get(row[0]) if type(row) is tuple and row and type(row[0]) is int else None
    if command_type is None:
        raise ProtocolError(f"command #{seq}: not a command row {clip(row)}")
    values = row[1:]
    types = (int,) + _FIELD_TYPES[command_type]
    if len(values) != len(types) or not all(_has_type(v, t) for v, t in zip(values, types)):
        raise ProtocolError(f"command #{seq}: malformed {command_type.__name__} {clip(values)}")
    if values[0] != seq:
        raise ProtocolError(f"command #{seq}: numbered #{values[0]}")
    return command_type(*values)


def _has_type(value, expected) -> bool:
    if expected is IDS:
        return type(value) is tuple and all(type(v) is int for v in value)
    return type(value) is expected


# What each message a worker sends must hold after (VERSION, kind), and how many data frames may
# follow its header. The controller checks both before looking at any value (check_from_worker).
FROM_WORKER = {
    Kind.REGISTER: ((int, str, int, str, str), 0),      # rank, host, pid, device, secret
    Kind.REPLY: ((int, int, str, int), 1),              # seq, rank, status, origin_seq; bytes?
    Kind.ERROR: ((int, int, str, str, str, str), 0),    # seq, rank, op, type, message, traceback
    Kind.HEARTBEAT: ((int,), 0),                        # rank
}
REPLY_STATUSES = ("ok", "poisoned", "missing")


def check_from_worker(fields: tuple, data_frames: int) -> Kind:
    """The kind of a header read_header accepted, once its fields have the types FROM_WORKER
    names (bool is not an int here) and at most the data frames it allows."""
    kind = fields[1]
    if type(kind) is not int or kind not in FROM_WORKER.keys():
        raise ProtocolError(f"unexpected message kind {kind!r}")
    kind = Kind(kind)
    types, most_frames = FROM_WORKER[kind]
    values = fields[2:]
    if len(values) != len(types) or any(type(v) is not t for v, t in zip(values, types)):
        raise ProtocolError(f"malformed {kind.name}: {clip(values)}")
    if data_frames > most_frames:
        raise ProtocolError(f"{kind.name} with {data_frames} data frames")
    return kind


def clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def header(kind: Kind, *fields) -> bytes:
    return pack((VERSION, int(kind)) + fields)


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
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_from_frame(buffer, dtype: torch.dtype, shape) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.frombuffer(bytearray(buffer) if isinstance(buffer, bytes) else buffer, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))
