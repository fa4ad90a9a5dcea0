"""CURVE on the controller's channels: a process without the run's keys can neither read commands
nor inject replies, and workers that hold the keys work as usual."""
import json

from support import run_script

PROBE = """
import json, time, torch, zmq, dtorch
from dtorch.distributed_spec import init_device_mesh, Shard
from dtorch.runtime import session, protocol as wire

dtorch.init(num_workers=2, curve=True)
mesh = init_device_mesh("cpu", (2,))
controller = session.current()
context = zmq.Context()

def socket(kind, keys=None, identity=None, address=controller.sockets.command_address):
    s = context.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if keys:
        s.curve_serverkey = controller.curve.server_public.encode()
        s.curve_publickey, s.curve_secretkey = keys
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(address)
    return s

stranger_keys = zmq.curve_keypair()
listeners = [socket(zmq.SUB), socket(zmq.SUB, stranger_keys)]
injectors = [socket(zmq.DEALER, None, b"w0", controller.sockets.reply_address),
             socket(zmq.DEALER, stranger_keys, b"w1", controller.sockets.reply_address)]
time.sleep(0.5)
x = dtorch.arange(8, device_mesh=mesh, placements=[Shard(0)]) * 1.0
for _ in range(50):
    x = x + 1
next_seq = controller._next_seq

def forge(injector, frames):
    try:   # a DEALER whose handshake was refused has no peer: a blocking send would wait forever
        injector.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass

for injector in injectors:
    for seq in range(next_seq, next_seq + 20):   # forged replies for the reads to come
        for rank in (0, 1):
            forge(injector, [wire.header(wire.Kind.REPLY, seq, rank, "ok", -1), b"\\x00" * 64])
    forge(injector, [wire.header(wire.Kind.REGISTER, 0, "evil", 1, "cpu")])
value = x.to_torch()
heard = [bool(s.poll(1000)) for s in listeners + injectors]
print(json.dumps({"value": value.tolist(), "heard": heard}))
context.destroy(linger=0)
dtorch.shutdown()
"""


def test_without_the_keys_nothing_is_heard_and_nothing_injected():
    result = run_script(PROBE, timeout=90)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["value"] == [float(i + 50) for i in range(8)]
    assert report["heard"] == [False, False, False, False], report
