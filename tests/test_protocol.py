"""The wire records: every message kind is a typed record that round-trips, a malformed one is a
ProtocolError naming what is wrong, and each side has one handler per kind it receives."""
import pytest

from dtorch.errors import ProtocolError
from dtorch.runtime import protocol as wire
from dtorch.runtime.controller.controller import Controller
from dtorch.runtime.controller.worker_messages import WorkerMessages
from dtorch.runtime.worker.worker import Worker

EXAMPLES = [wire.Batch(3, 2), wire.Private(7), wire.Probe(), wire.Register(1, "host", 42, "cpu", "s3cret", 2),
            wire.Welcome(5, "tcp://127.0.0.1:1234", 120.0), wire.Refused("why"), wire.Reply(9, 1, "ok", -1),
            wire.ErrorReport(9, 1, "add", "ValueError", "bad", "Traceback ..."),
            wire.WarningReport(9, 1, "UserWarning", "careful"), wire.Heartbeat(3, 12, 1 << 30, 7, 1.5), wire.Pong()]


def test_every_message_kind_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(wire.MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message):
    decoded = wire.decode(wire.encode(message), (type(message),))
    assert type(decoded) is type(message) and decoded == message


def test_decode_refuses_unexpected_kinds_and_wrong_field_types():
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        wire.decode(wire.encode(wire.Pong()), wire.FROM_WORKER)
    forged = wire.pack((wire.VERSION, int(wire.Kind.REPLY), 1, True, "ok", -1))   # bool is not a rank
    with pytest.raises(ProtocolError, match="malformed Reply"):
        wire.decode(forged, wire.FROM_WORKER)
    with pytest.raises(ProtocolError, match="version"):
        wire.decode(wire.pack((wire.VERSION + 1, int(wire.Kind.PONG))), (wire.Pong,))


def test_the_controller_has_one_handler_per_message_a_worker_sends():
    for kind in wire.FROM_WORKER:
        assert callable(getattr(WorkerMessages, wire.handler_name(kind, "_on_"), None)), kind.__name__


def test_run_op_carries_the_users_op_and_the_kernel():
    assert wire.RunOp._fields[3:5] == ("op", "kernel")


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, frames):
        self.sent.append(wire.decode(frames[0], wire.FROM_WORKER))


def test_a_failing_kernel_is_reported_under_the_op_the_user_called():
    from dtorch.runtime.devices.device import CpuDevice
    worker = Worker(0, Replies(), None, CpuDevice(), start_seq=0)
    worker._execute(wire.DefineMesh(0, 0, "cpu", (1,), (0,)))
    worker._execute(wire.Factory(1, 1, 0, "arange", (6,), "float32", (wire.decode_placement(0),), (0.0, 1.0)))
    # reshape's rule picks the kernel reshape_local; a bad shape makes it raise on the worker
    worker._execute(wire.RunOp(2, (2,), 0, "reshape", "reshape_local", (wire.TensorRef(1), (4, 4)), {}, ()))
    report = worker.sockets.sent[-1]
    assert type(report) is wire.ErrorReport and report.seq == 2
    assert report.op == "reshape" and "reshape_local" in report.traceback


def test_an_error_older_than_the_call_site_ring_says_its_line_is_gone():
    from dtorch.runtime.controller.command_sites import SITE_RING
    controller = Controller()

    def issue():   # submit records the line that called its caller, as dtorch's own calls do
        return controller.submit(wire.Sync)
    try:
        for _ in range(SITE_RING + 1):
            last = issue()
        assert "test_protocol.py" in controller.sites.site_of(last)
        assert "not kept" in controller.sites.site_of(0)   # its slot now holds command #SITE_RING's line
    finally:
        controller.shutdown()


def test_a_shard_region_travels_as_its_own_type():
    from dtorch.spec.placements import DeviceMesh, Partial, Shard, ShardRegion
    region = ShardRegion((10, 4), (Shard(0), Partial()))
    assert wire.unpack(wire.pack({"region": region})) == {"region": region}
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert region.at(mesh, (1, 0)) == ([5, 0], [5, 4])


def _placements(*codes):
    return tuple(wire.decode_placement(c) for c in codes)


COMMAND_EXAMPLES = [
    wire.DefineMesh(0, 0, "cpu", (2, 2), (0, 1, 2, 3)),
    wire.Factory(1, 1, 0, "full", (4, 6), "float32", _placements(0, -1), (2.5,)),
    wire.Upload(2, 2, 0, (4,), "bfloat16", _placements(-2, 0)),
    wire.LoadShard(3, 3, 0, (7, 5), "bfloat16", _placements(0, 1), "/ckpt/model-00001.safetensors",
                   "embed.weight", 1 << 33, "float32"),
    wire.RunOp(4, (4,), 0, "add", "add", (wire.TensorRef(1), wire.TensorRef(2)), {"alpha": 2}, (), True),
    wire.Redistribute(5, 5, 1, 0, (4, 6), "float32", _placements(0, -1), ((0, _placements(0)[0], _placements(-1)[0]),),
                      True),
    wire.Transfer(6, 6, 1, 0, 1, (4, 6), "float32", _placements(0, -1), _placements(-1)),
    wire.Fetch(7, 1, 0, (0, 2)), wire.Free(8, (1, 2)), wire.Sync(9), wire.Shutdown(10),
    wire.Regroup(11, 1, (2,)),
    wire.RequireGrad(12, (1, 2), True), wire.SetGrads(13, (1, 2), (5, -1)),
    wire.Backward(14, 0, (4,), (5,), (1, 2), (6, 7), "backward", False),
    wire.OptimizerStep(15, 0, "AdamW", {"lr": 0.1, "betas": (0.9, 0.999), "amsgrad": False}, (1, 2), (3, 4),
                       (5, 6, 7, 8), (0, 3), (1, 0)),
    wire.GradNorm(16, 9, 0, float("inf"), (3, 4), (_placements(0, -1), _placements(-1, 1))),
    wire.UpdateGrads(17, 0, "clip_grad_norm_", (3, 4), 9, 0.0),
    wire.SaveShard(18, "/ckpt/.run.saving-x", 0, ((0, 1, "model.w"), (3, 2, "optim.state.0.exp_avg"))),
    wire.LoadChunks(19, 7, 0, (7, 5), "float32", _placements(1, -1),
                    (("/ckpt/__0_0.safetensors", 96, "bfloat16", (0, 0), (4, 5)),
                     ("/ckpt/__1_0.safetensors", 96, "bfloat16", (4, 0), (3, 5))), "model.w"),
    wire.Profile(20, True),
    wire.DefineGraph(21, 1, (wire.command_row(wire.RunOp(4, (4,), 0, "mul", "mul", (wire.TensorRef(1), 0.5), {}, ())),
                             wire.command_row(wire.Free(5, (4,)))), (1,), (4,), (), (), (), ((0, 1, 0),)),
    wire.RunGraph(22, 1, 2, (8,), (9,), 7, 3, (), 21, (), (0.25,)),   # spans seqs 22 and 23
    wire.DropGraph(24, 1),
    wire.CheckpointBegin(25), wire.CheckpointEnd(26),
]


def test_every_command_has_an_example():
    assert {type(c) for c in COMMAND_EXAMPLES} == set(wire.COMMANDS)


def test_commands_round_trip_in_a_batch():
    _, header, body = wire.encode_batch(0, COMMAND_EXAMPLES)
    assert wire.decode_batch(wire.decode(header, (wire.Batch,)), body) == COMMAND_EXAMPLES


@pytest.mark.parametrize("tensor_id", [0, 1, 7, 1 << 40, -1])
def test_the_controllers_tensor_reference_goes_on_the_wire_as_a_workers_tensor_ref(tensor_id):
    """The controller's WireRef is packed by msgpack in C; a worker must read it exactly as the
    TensorRef it stands for, in an op's args, in nested lists and in kwargs."""
    sent = wire.RunOp(4, (4,), 0, "cat", "cat", ([wire.wire_ref(tensor_id), wire.wire_ref(3)],),
                      {"other": wire.wire_ref(tensor_id)}, ())
    _, header, body = wire.encode_batch(4, [sent])
    (received,) = wire.decode_batch(wire.decode(header, (wire.Batch,)), body)
    assert received.args == ((wire.TensorRef(tensor_id), wire.TensorRef(3)),)
    assert type(received.args[0][0]) is wire.TensorRef and received.kwargs == {"other": wire.TensorRef(tensor_id)}
    assert wire.wire_ref(tensor_id).id == tensor_id and repr(wire.wire_ref(tensor_id)) == f"TensorRef({tensor_id})"
    assert wire.pack(wire.wire_ref(tensor_id)) == wire.pack(wire.TensorRef(tensor_id))


@pytest.mark.parametrize("example", COMMAND_EXAMPLES, ids=lambda c: type(c).__name__)
def test_a_command_with_any_field_of_the_wrong_type_is_refused(example):
    """Every field of every command, replaced by a value of another type (a bool where an int
    belongs, an int in a string's place), and every id list holding a non-int: refused."""
    row = wire.command_row(example)
    declared = (None, int) + wire._FIELD_TYPES[type(example)]   # the opcode, seq, the fields
    bad_rows = []
    for i in range(1, len(row)):
        wrong = 1.5 if type(row[i]) is str else True if type(row[i]) is int else "x"
        bad_rows.append(row[:i] + (wrong,) + row[i + 1:])
        if declared[i] is wire.IDS and row[i]:
            bad_rows += [row[:i] + ((*row[i][:-1], bad),) + row[i + 1:] for bad in (True, 1.0, "1")]
    for bad in bad_rows:
        with pytest.raises(ProtocolError, match=f"malformed {type(example).__name__}|numbered"):
            wire.decode_batch(wire.Batch(example.seq, 1), wire.pack([bad]))


def test_a_load_shard_with_a_field_of_the_wrong_type_is_refused():
    row = (wire.OPCODE[wire.LoadShard], 0, 3, 0, (7, 5), "bfloat16", (), "/ckpt/x.safetensors", "w", "8", "float32")
    with pytest.raises(ProtocolError, match="malformed LoadShard"):
        wire.decode_batch(wire.Batch(0, 1), wire.pack([row]))
