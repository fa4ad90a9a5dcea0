"""CURVE on the controller's channels: a process without the run's keys can neither read commands
nor inject replies, and workers that hold the keys work as usual."""
import json
import os
import shutil
import subprocess

import pytest

from support import run_script

PROBE = """
import json, time, torch, zmq, dtorch
from dtorch.spec.placements import init_device_mesh, Shard
from dtorch.runtime.controller import session; from dtorch.runtime import protocol as wire

dtorch.init(num_workers=2, curve=True)
mesh = init_device_mesh("cpu", (2,))
controller = session.controller()
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
            forge(injector, [wire.encode(wire.Reply(seq, rank, "ok", -1)), b"\\x00" * 64])
    forge(injector, [wire.pack((wire.VERSION, int(wire.Kind.REGISTER), 0, "evil", 1, "cpu"))])
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


# --- the local default: private ipc sockets, the run's secret ------------------------------------
# A process that knows the addresses but not the secret: it listens to everything and forges a
# registration, replies for the reads to come, an error and heartbeats under guessed identities.
# It prints what it managed; it runs as the user its caller chose.
INTRUDER = r"""
import json, sys, time, zmq, msgpack
commands, replies, next_seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
VERSION, REGISTER, REPLY, ERROR, HEARTBEAT = 2, 10, 12, 13, 14
pack = lambda *fields: msgpack.packb((VERSION,) + fields, use_bin_type=True)
context = zmq.Context()
def socket(kind, address, identity=None):
    s = context.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if identity: s.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.SUB: s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(address)
    return s
listener = socket(zmq.SUB, commands)
forgers = [socket(zmq.DEALER, replies, i) for i in (b"w0", b"w0:guess", b"h0", b"h1:guess", None)]
time.sleep(0.5)
sent = 0
for forger in forgers:
    frames = [[pack(REGISTER, 0, "evil", 1, "cpu", "0" * 64)], [pack(HEARTBEAT, 0)], [pack(HEARTBEAT, 1)],
              [pack(ERROR, next_seq + 3, 0, "add", "ValueError", "forged", "")]]
    frames += [[pack(REPLY, seq, rank, "ok", -1), b"\x00" * 64]
               for seq in range(next_seq, next_seq + 30) for rank in (0, 1)]
    for message in frames:
        try:
            forger.send_multipart(message, flags=zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
print("READY", flush=True)
heard = bool(listener.poll(3000))
answers = []   # the kinds the controller sent back: REFUSED (16) is fine, WELCOME or PONG is not
for forger in forgers:
    while forger.poll(200):
        answers.append(msgpack.unpackb(forger.recv_multipart()[0])[1])
print(json.dumps({"heard": heard, "answers": sorted(set(answers)), "sent": sent}), flush=True)
context.destroy(linger=0)
"""

# What another user can run (our interpreter lives under /root; the system one has no zmq): raw
# connect() calls on both ipc socket paths, which is all a ZeroMQ peer would do first.
RAW_INTRUDER = r"""
import json, socket, sys
errors = []
for address in sys.argv[1:3]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address.removeprefix("ipc://"))
        errors.append(None)
    except OSError as error:
        errors.append(type(error).__name__)
print("READY", flush=True)
print(json.dumps({"heard": False, "answers": [], "sent": 0, "connect_errors": errors}), flush=True)
"""

# The controller side: a default local session (no hostfile, no curve), the intruder started as
# the given user, a computation and its read while the intruder is at work.
CONTROLLER = r"""
import json, os, stat, subprocess, sys, torch, dtorch
from dtorch.spec.placements import init_device_mesh, Shard
from dtorch.runtime.controller import session
user, intruder, raw_intruder = sys.argv[1], sys.argv[2], sys.argv[3]
mesh = init_device_mesh("cpu", (2,))
controller = session.controller()
sockets = controller.sockets
private_dir = sockets.private_dir
x = dtorch.arange(8, device_mesh=mesh, placements=[Shard(0)]) * 1.0
dtorch.synchronize()
command = [sys.executable, "-c", intruder, sockets.command_address, sockets.reply_address, str(controller._next_seq)]
if user != "-":
    command = ["runuser", "-u", user, "--", "/usr/bin/python3", "-c", raw_intruder] + command[3:]
process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd="/")
assert process.stdout.readline().strip() == "READY"
for _ in range(20):
    x = x + 1
value = x.to_torch()
report = json.loads(process.stdout.readline())
process.wait(30)
report.update(value=value.tolist(), rejected=dtorch.stats()["messages_rejected"],
              mode=oct(stat.S_IMODE(os.stat(private_dir).st_mode)),
              addresses=[sockets.command_address, sockets.reply_address],
              store=controller.store_address, workers_alive=all(w["alive"] for w in dtorch.workers()))
dtorch.shutdown()
report["dir_removed"] = not os.path.exists(private_dir)
print(json.dumps(report))
"""


def run_intrusion(user: str) -> dict:
    result = run_script(CONTROLLER.replace("sys.argv[1], sys.argv[2], sys.argv[3]",
                                                  f"{user!r}, {INTRUDER!r}, {RAW_INTRUDER!r}"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.fixture(scope="module")
def stranger():
    """A Unix user of its own for the test run, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user needs root (CI runs as root)")
    if shutil.which("useradd") is None or shutil.which("runuser") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("useradd, runuser or /usr/bin/python3 (a Python another user may run) is missing")
    name = f"dtstr{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def test_another_user_can_neither_listen_nor_send(stranger):
    report, _ = run_intrusion(stranger)
    assert report["value"] == [float(i + 20) for i in range(8)]
    assert report["connect_errors"] == ["PermissionError", "PermissionError"], report
    assert report["rejected"] == 0, "nothing of theirs may even arrive"
    assert all(a.startswith("ipc://") for a in report["addresses"]), report
    assert report["mode"] == "0o700" and report["dir_removed"], report
    assert report["store"].startswith("127.0.0.1:") and report["workers_alive"], report


def test_the_same_user_without_the_secret_gets_nothing_accepted():
    """Same user: the ipc socket is reachable (file permissions cannot tell two processes of one
    user apart), so it hears the commands (docs/design/launcher.md says so; dtorch.init(curve=True)
    closes that, test above), but none of its messages is accepted, and each drop is counted and
    logged without a traceback."""
    report, stderr = run_intrusion("-")
    assert report["value"] == [float(i + 20) for i in range(8)]
    assert report["answers"] in ([], [16]) and report["workers_alive"], report   # REFUSED at most
    assert report["rejected"] == report["sent"] > 0, report
    assert 0 < stderr.count("dropped a message") <= 10, stderr


def test_the_rendezvous_store_listens_on_loopback_only():
    from dtorch.runtime.controller.rendezvous import host_store
    store, address = host_store("127.0.0.1", 5)
    port = int(address.rsplit(":", 1)[1])
    listening = [line.split()[1] for name in ("/proc/net/tcp", "/proc/net/tcp6")
                 for line in open(name).read().splitlines()[1:] if line.split()[3] == "0A"]
    mine = [local for local in listening if int(local.rsplit(":", 1)[1], 16) == port]
    assert mine == ["0100007F:%04X" % port], mine
    del store


# --- private by default on any transport: CURVE on every TCP session, loopback included ----------
LOOPBACK_TCP = """
import json, os, time, zmq, dtorch
from dtorch.spec.placements import init_device_mesh, Shard
from dtorch.runtime.controller import session
os.environ.update(ENVIRONMENT)
dtorch.init(num_workers=2, **OPTIONS)
controller = session.controller()
mesh = init_device_mesh("cpu", (2,))
context = zmq.Context()
listener = context.socket(zmq.SUB)   # no keys: what any local user could open on a TCP port
listener.setsockopt(zmq.LINGER, 0)
listener.setsockopt(zmq.SUBSCRIBE, b"")
listener.connect(controller.sockets.command_address)
time.sleep(0.5)
x = dtorch.arange(8, device_mesh=mesh, placements=[Shard(0)]) * 1.0
for _ in range(20):
    x = x + 1
value = x.to_torch()
heard = bool(listener.poll(1000))
print(json.dumps({"address": controller.sockets.command_address, "curve": controller.curve is not None,
                  "heard": heard, "value": value.tolist()}))
context.destroy(linger=0)
dtorch.shutdown()
"""


@pytest.mark.parametrize("options, environment, curve", [
    ({"controller_address": "127.0.0.1"}, {}, True),                        # the default
    ({"controller_address": "127.0.0.1", "curve": False}, {}, False),       # opting out in code
    ({"controller_address": "127.0.0.1"}, {"DTORCH_CURVE": "0"}, False),    # ... or in the environment
    ({"controller_address": "127.0.0.1", "curve": True}, {"DTORCH_CURVE": "0"}, True),   # the argument wins
    ({}, {}, False),                                                       # local: private ipc, no CURVE
    ({}, {"DTORCH_CURVE": "1"}, True),
])
def test_a_loopback_tcp_session_is_encrypted_unless_turned_off(options, environment, curve):
    source = LOOPBACK_TCP.replace("ENVIRONMENT", repr(environment)).replace("OPTIONS", repr(options))
    result = run_script(source, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["value"] == [float(i + 20) for i in range(8)]
    assert report["address"].startswith("tcp://127.0.0.1:" if options else "ipc://"), report
    assert report["curve"] is curve, report
    # an unauthenticated subscriber hears the commands only where CURVE is off (and on ipc,
    # only because it runs as this user: test_another_user_can_neither_listen_nor_send)
    assert report["heard"] is not curve, report


def test_a_bad_dtorch_curve_value_is_refused_naming_it():
    result = run_script("""
        import os, dtorch
        os.environ["DTORCH_CURVE"] = "maybe"
        try:
            dtorch.init(num_workers=1, controller_address="127.0.0.1")
        except ValueError as error:
            print("REFUSED", error)
    """, timeout=60)
    assert result.returncode == 0 and "REFUSED DTORCH_CURVE='maybe': expected 0" in result.stdout, result.stderr
