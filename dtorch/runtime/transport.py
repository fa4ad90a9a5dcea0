"""The one module that imports zmq: sockets for both sides, with every option that keeps the
PUB/SUB channel lossless (no high-water-mark drops), fast to close (linger 0) and private: local
sessions listen on ipc:// sockets in a directory only this user can enter, sessions across hosts
on TCP with CURVE.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import NamedTuple

import zmq

from ..errors import StartupError

__all__ = ["CurveKeys", "make_curve_keys", "ControllerSockets", "WorkerSockets", "RelaySockets", "Again",
           "process_exists"]

Again = zmq.Again


class CurveKeys(NamedTuple):
    """Z85 keys (str) for one run: the controller's server pair and the workers' client pair."""
    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    def for_worker(self) -> dict:
        """What a worker needs: never the server's secret."""
        return {"server_public": self.server_public, "client_public": self.client_public,
                "client_secret": self.client_secret}


def make_curve_keys() -> CurveKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(*[k.decode() for k in (server_public, server_secret, client_public, client_secret)])


def _lossless(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)   # 0 = no limit: PUB drops at the HWM, so there is none
    socket.setsockopt(zmq.RCVHWM, 0)


def _curve_server(socket: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        socket.curve_server = True
        socket.curve_secretkey = keys.server_secret.encode()
        socket.curve_publickey = keys.server_public.encode()


def _curve_client(socket: zmq.Socket, keys: dict | None) -> None:
    if keys is not None:
        socket.curve_serverkey = keys["server_public"].encode()
        socket.curve_publickey = keys["client_public"].encode()
        socket.curve_secretkey = keys["client_secret"].encode()


LOCAL = None   # ControllerSockets(host=LOCAL): ipc sockets in a private directory
# Plain ints: pyzmq's constants are enum.IntFlag, whose `&` runs in Python (~0.7 us each); the
# reply path tests EVENTS and RCVMORE several times per message.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
# A publish sends its frames through pyzmq's Cython send with plain int flags: send_multipart's
# Python wrapper ORs IntFlag enums twice per message (about 1 us of enum arithmetic), which a
# dtorch.compile replay, one message per call, paid on every call.
_SEND, _SNDMORE = zmq.backend.Socket.send, int(zmq.SNDMORE)


def _poller_for(socket) -> zmq.Poller:
    """A Poller kept for one socket: Socket.poll builds and registers a new one per call."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    return poller


class ControllerSockets:
    """PUB for commands, ROUTER for everything workers send back; bound on `host`, random ports,
    or with host=LOCAL on two ipc:// sockets in a fresh directory of mode 0700 (mkdtemp), which
    no other user can enter: the kernel refuses their connect(). It is removed at close.

    Not thread-safe, as no ZeroMQ socket is: the controller publishes under its publish lock,
    and receives and replies on the ROUTER under its router lock, from the loop thread (which
    watches the ROUTER's file descriptor) or from a thread that blocks on a read
    (`wait_for_reply`). Either drains every queued message in one go (`drain`), which costs far
    less per message than one awaited future per receive.

    With CURVE on, a ZAP handler admits only the run's client key, so a process without the
    keys can neither subscribe to commands nor inject replies."""

    def __init__(self, host: str | None = "127.0.0.1", keys: CurveKeys | None = None):
        self.context = zmq.Context()
        self.private_dir = _private_dir() if host is LOCAL else None
        self._authenticator = _start_authenticator(self.context, keys) if keys else None
        self.pub = self.context.socket(zmq.PUB)
        self.router = self.context.socket(zmq.ROUTER)
        for socket in (self.pub, self.router):
            _lossless(socket)
            _curve_server(socket, keys)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, not vanishes
        self.command_address = _bind(self.pub, host, self.private_dir, "commands")
        self.reply_address = _bind(self.router, host, self.private_dir, "replies")
        self.bytes_sent = self.bytes_received = self.messages_sent = 0
        self._reply_poller = _poller_for(self.router)   # used under the router lock, like the socket

    @property
    def reply_fd(self) -> int:
        """Readable when the ROUTER *may* have messages (ZeroMQ's descriptor is edge-triggered:
        always drain until EVENTS says empty)."""
        return self.router.getsockopt(zmq.FD)

    def publish(self, frames: list, copy: bool = True) -> None:
        # PUB with no high-water mark never blocks.
        pub, last = self.pub, frames[-1]
        for frame in frames[:-1]:
            _SEND(pub, frame, _SNDMORE, copy)
        _SEND(pub, last, 0, copy)
        self.messages_sent += 1
        self.bytes_sent += sum(len(f) for f in frames)

    def send_to(self, identity: bytes, frames: list) -> None:
        try:
            self.router.send_multipart([identity] + frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # the worker is gone (ROUTER_MANDATORY); liveness tracking reports it
        self.messages_sent += 1
        self.bytes_sent += sum(len(f) for f in frames)

    def wait_for_reply(self, seconds: float) -> bool:
        """Block (without the GIL) until the ROUTER may have a message, or `seconds` pass."""
        return bool(self._reply_poller.poll(max(1, round(seconds * 1000))))

    def spin_for_reply(self, until: float) -> bool:
        """Ask the ROUTER whether a message may be queued, again and again without sleeping (the
        GIL kept), until time.monotonic() reaches `until`. EVENTS also runs the socket's pending
        commands from zmq's I/O thread, which is how a message becomes visible without a poll."""
        router, clock = self.router, time.monotonic
        while not router.getsockopt(_EVENTS) & _POLLIN:
            if clock() >= until:
                return False
        return True

    def drain(self):
        """Yield (sender identity, header or None, data frames) for every message queued on the
        ROUTER now; re-checks after each one, so replies sent while handling a message (which can
        swallow the descriptor's edge) lose nothing. The identity and header come as bytes (both
        are small, and a zmq.Frame costs ~1.5 us more each); data frames as zero-copy Frames."""
        router = self.router
        while router.getsockopt(_EVENTS) & _POLLIN:
            identity = router.recv(zmq.NOBLOCK)   # every part of a message has arrived with the first
            header = router.recv(zmq.NOBLOCK) if router.getsockopt(_RCVMORE) else None
            data = []
            while router.getsockopt(_RCVMORE):
                data.append(router.recv(zmq.NOBLOCK, copy=False))
            self.bytes_received += len(identity) + len(header or b"") + sum(len(f.buffer) for f in data)
            yield identity, header, data

    def close(self) -> None:
        for socket in (self.pub, self.router):
            socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.term()
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def _private_dir() -> str:
    """mkdtemp: a unique name (concurrent sessions never collide) created with mode 0700.
    A socket path must fit in sockaddr_un (107 bytes): fall back to /tmp for a long TMPDIR.
    The name carries this process's pid, so a later session removes the directories that
    controllers killed without a shutdown (SIGKILL) left behind."""
    prefix = f"dtorch-{os.getpid()}-"
    path = tempfile.mkdtemp(prefix=prefix)
    if len(path) + len("/commands") > 100:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    _remove_stale_dirs(os.path.dirname(path))
    return path


def _remove_stale_dirs(parent: str) -> None:
    """This user's dtorch-<pid>-* directories whose controller process no longer exists."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "dtorch" or not parts[1].isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if os.stat(path).st_uid != os.getuid() or process_exists(int(parts[1])):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def process_exists(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's counts; dtorch.checkpoint uses it too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def _bind(socket: zmq.Socket, host: str | None, private_dir: str | None, name: str) -> str:
    if private_dir is not None:
        address = f"ipc://{private_dir}/{name}"
        socket.bind(address)
        return address
    try:
        port = socket.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as error:   # an address not of this machine (controller_address, a hostfile's)
        raise StartupError(f"the controller cannot listen on {host!r}: {error}") from None
    return f"tcp://{host}:{port}"


def _start_authenticator(context, keys: CurveKeys):
    from zmq.auth.thread import ThreadAuthenticator
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=_OnlyKey(keys.client_public))
    return authenticator


class _OnlyKey:
    def __init__(self, client_public: str):
        self.allowed = client_public.encode()

    def callback(self, domain, key) -> bool:
        import zmq.utils.z85
        return zmq.utils.z85.encode(key) == self.allowed if len(key) == 32 else key == self.allowed


class WorkerSockets:
    """A worker's SUB (commands) and DEALER (replies); blocking, used from the worker's main thread."""

    def __init__(self, command_address: str, reply_address: str, rank: int, topics: list[bytes],
                 keys: dict | None = None, relayed: bool = False):
        """relayed: commands come from this host's relay (runtime/processes/relay.py) over an ipc socket
        in a directory only this user can enter, which never leaves the host: no CURVE on the SUB.
        Replies and heartbeats always go straight to the controller, with CURVE when it is on."""
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.dealer = self.context.socket(zmq.DEALER)
        for socket in (self.sub, self.dealer):
            _lossless(socket)
        _curve_client(self.sub, None if relayed else keys)
        _curve_client(self.dealer, keys)
        # w<rank>:<random>: the controller binds the rank to this identity when it registers,
        # and a stranger cannot guess it (nor take it first: it is new for every process).
        self._suffix = os.urandom(12).hex().encode()
        self.dealer.setsockopt(zmq.IDENTITY, b"w%d:%s" % (rank, self._suffix))
        for topic in topics:
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(command_address)
        self.dealer.connect(reply_address)
        self._reply_address, self._keys = reply_address, keys
        self._command_poller = _poller_for(self.sub)

    def heartbeat_link(self, rank: int, silence_timeout_s: float) -> HeartbeatLink:
        """A second DEALER for the heartbeat thread (zmq sockets are not thread-safe)."""
        socket = self.context.socket(zmq.DEALER)
        _lossless(socket)
        _curve_client(socket, self._keys)
        socket.setsockopt(zmq.IDENTITY, b"h%d:%s" % (rank, self._suffix))
        return HeartbeatLink(socket, self._reply_address, silence_timeout_s)

    def receive_command(self, timeout_ms: int | None = None) -> list | None:
        if timeout_ms is not None and not self._command_poller.poll(timeout_ms):
            return None
        return self.sub.recv_multipart(copy=False)

    def receive_reply(self, timeout_ms: int) -> list | None:
        if not self.dealer.poll(timeout_ms):
            return None
        return self.dealer.recv_multipart()

    def send(self, frames: list) -> None:
        self.dealer.send_multipart(frames, copy=False)

    def close(self) -> None:
        self.context.destroy(linger=0)


class RelaySockets:
    """A host's relay (runtime/processes/relay.py): one SUB to the controller's PUB (TCP, with CURVE when
    the run has keys) subscribed to the topics of every rank on this host, and one PUB bound on
    an ipc:// socket in `directory` (mode 0700, made by the relay) that the host's workers
    connect to. `forward()` copies every message, frames unchanged, so the workers' sequence
    checks stay end to end.

    The upstream subscriptions are fixed at start, the probe topic with the rest: the controller
    takes one connection's subscriptions in one go, so a probe that reached this relay proves
    every rank's private topic is subscribed too (workers register only after a probe; forwarding
    their own subscriptions upstream one by one would let a worker see a probe before its private
    topic reached the controller)."""

    def __init__(self, upstream: str, directory: str, topics: list[bytes], keys: dict | None,
                 silence_timeout_s: float):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.pub = self.context.socket(zmq.PUB)
        for socket in (self.sub, self.pub):
            _lossless(socket)
        _curve_client(self.sub, keys)
        # ZMTP heartbeats, answered by the controller's ZeroMQ I/O thread (never held up by its
        # Python code): a controller host that goes silent drops this connection.
        self.sub.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(silence_timeout_s * 1000))
        self.monitor = self.sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        for topic in topics:
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.address = f"ipc://{directory}/commands"
        self.pub.bind(self.address)
        self.sub.connect(upstream)

    def next_event(self) -> str:
        """Block until the upstream connection changes: "connected", "disconnected" or
        "refused" (the CURVE handshake failed: wrong keys, or not the run's controller)."""
        from zmq.utils.monitor import recv_monitor_message
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            return "connected"
        return "disconnected" if event == zmq.EVENT_DISCONNECTED else "refused"

    def forward(self) -> None:
        """Copy messages downstream until the context ends (runs in C, without the GIL)."""
        try:
            zmq.proxy(self.sub, self.pub)
        except zmq.ContextTerminated:
            pass


class HeartbeatLink:
    """The heartbeat thread's DEALER to the controller, and whether ZeroMQ still holds a live
    connection to it. ZMTP heartbeats (a PING every second) are answered by the controller's
    ZeroMQ I/O thread, which runs without Python's GIL: a controller whose Python is paused (a
    long garbage collection) keeps the connection, and one that is stopped, gone or cut off
    loses it after `silence_timeout_s`."""

    def __init__(self, socket: zmq.Socket, address: str, silence_timeout_s: float):
        self.socket = socket
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(silence_timeout_s * 1000))
        # Watched from before the connect: a handshake (CURVE's too) done is "up", a drop "down".
        self.monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._up = True   # the worker registered through the same endpoint a moment ago
        socket.connect(address)

    def send(self, frames: list) -> None:
        self.socket.send_multipart(frames)

    def receive(self, timeout_ms: int) -> list | None:
        if not self.socket.poll(timeout_ms):
            return None
        return self.socket.recv_multipart()

    def connected(self) -> bool:
        """Whether the latest connection event says the controller's end is there."""
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            self._up = recv_monitor_message(self.monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return self._up
