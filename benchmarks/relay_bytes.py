"""11. What leaves the controller over dtorch-launch: two ssh hosts (real sshd servers on
127.0.0.2 and 127.0.0.3, as in tests/launcher), the same program with 1 and 4 workers per host,
4 per host with and without the per-host relays (DTORCH_RELAY=0).

The count is the kernel's: `ss -tin` bytes_sent of every TCP connection of the controller's
command PUB socket, before and after the program (tests/launcher/relay_over_ssh.py --bytes), per
op. The reply side is quoted in the note: bytes the controller's ROUTER received meanwhile
(replies and heartbeats, one stream per worker whatever the relays do).

Second part: why replies do not go through the relay. Each reply is one worker's own message
(its status or its shard), so a relay would forward as many bytes as it receives; what it would
add is one more hop on every read. The rows time a DEALER -> ROUTER round trip on tcp loopback,
direct and through one ipc hop and a zmq.proxy (what a reply relay would be).
"""
from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

from .timing import Row, guarded

NAME = "relay_bytes"
TITLE = "11. Controller bytes per op over dtorch-launch, 2 ssh hosts (bytes, not seconds); a reply hop"
ROOT = Path(__file__).resolve().parent.parent
LAUNCHER_TESTS = ROOT / "tests" / "launcher"
ONE = "1 worker per host"
DIRECT = "4 workers per host, no relay (DTORCH_RELAY=0)"
RELAYED = "4 workers per host, relays"
LAYOUTS = ((ONE, 1, True), (DIRECT, 4, False), (RELAYED, 4, True))


def run(suite) -> list[Row]:
    rows = _byte_rows(suite)
    return rows + _hop_rows(suite)


def _byte_rows(suite) -> list[Row]:
    sys.path.insert(0, str(LAUNCHER_TESTS))
    from launch_sshd import missing_tools
    ops = suite.relay_ops
    case = f"{ops} ops + 1 read, mesh over all slots"
    # The smoke suite runs 2 workers per host where the others run 4 (its names say so).
    layouts = [(variant.replace("4 ", f"{suite.relay_slots} "), slots if slots == 1 else suite.relay_slots, relay)
               for variant, slots, relay in LAYOUTS]
    reason = missing_tools()
    if reason:
        return [Row(NAME, case, variant, "op", status="not installed", note=reason) for variant, _, _ in layouts]
    with tempfile.TemporaryDirectory(prefix="dtorch-relay-bench-") as scratch, _SshHosts(Path(scratch)) as config:
        rows = []
        for index, (variant, slots, relay) in enumerate(layouts):
            def make_row(variant=variant, slots=slots, relay=relay, index=index) -> Row:
                measured = _launch(config, Path(scratch) / f"run{index}", slots, relay, ops, suite.process_timeout_s)
                reference = None if slots == 1 else (case, ONE)
                note = (f"{measured['connections']} PUB connections; the ROUTER received "
                        f"{measured['reply_bytes']} B in all (1 read, heartbeats)")
                return Row(NAME, case, variant, "op", [measured["bytes"] / ops], reference=reference, note=note,
                           unit="B")
            rows.append(guarded(make_row, NAME, case, variant, "op"))
        return rows


class _SshHosts:
    """Two sshd servers on loopback addresses, as tests/launcher/conftest.py starts them."""

    def __init__(self, directory: Path):
        self.directory = directory

    def __enter__(self) -> Path:
        from launch_sshd import SshServer, can_connect, free_port, generate_keys, write_ssh_config
        keys = generate_keys(self.directory)
        self.servers = [SshServer(keys, name, address, free_port(address))
                        for name, address in (("host-a", "127.0.0.2"), ("host-b", "127.0.0.3"))]
        try:
            for server in self.servers:
                server.start()
            for server in self.servers:
                server.wait_ready(can_connect)
        except BaseException:
            self.__exit__()
            raise
        return write_ssh_config(keys, self.servers, "bench")

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.stop()


def _launch(ssh_config: Path, directory: Path, slots: int, relay: bool, ops: int, timeout_s: float) -> dict:
    from launch_helpers import launch_mesh_script, read_tagged_line, stop_controller
    directory.mkdir()
    controller, stderr_path = launch_mesh_script(ssh_config, ["host-a", "host-b"], directory, "--bytes", str(ops),
                                                 script="relay_over_ssh.py", slots=slots,
                                                 env={"DTORCH_RELAY": "1" if relay else "0"})
    pids = []
    try:
        workers = json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))
        relays = json.loads(read_tagged_line(controller.stdout, "RELAYS ", stderr_path))
        pids = [w["pid"] for w in workers] + [r["pid"] for r in relays]
        measured = json.loads(read_tagged_line(controller.stdout, "BYTES ", stderr_path))
        if controller.wait(timeout_s) != 0:
            raise RuntimeError(f"the controller failed: {stderr_path.read_text()[-2000:]}")
        return measured
    finally:
        stop_controller(controller, pids)


# --- the reply path: direct, or through one more hop ------------------------------------------
def _hop_rows(suite) -> list[Row]:
    case = "DEALER -> ROUTER round trip, 64 B"
    direct = guarded(lambda: Row(NAME, case, "direct over tcp (dtorch's replies)", "read",
                                 _round_trips(False, suite.relay_round_trips)), NAME, case, "direct", "read")
    hopped = guarded(lambda: Row(NAME, case, "through an ipc hop + zmq.proxy (a reply relay)", "read",
                                 _round_trips(True, suite.relay_round_trips),
                                 reference=(case, "direct over tcp (dtorch's replies)")), NAME, case, "hop", "read")
    return [direct, hopped]


def _round_trips(hop: bool, count: int) -> list[float]:
    """Seconds per round trip, in batches of 100 (one sample per batch)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    with tempfile.TemporaryDirectory(prefix="dtorch-hop-") as directory:
        children = [context.Process(target=_echo, args=(ready,), daemon=True)]
        children[0].start()
        try:
            server = ready.get(timeout=60)
            address = server
            if hop:
                address = f"ipc://{directory}/hop"
                children.append(context.Process(target=_proxy, args=(address, server, ready), daemon=True))
                children[1].start()
                ready.get(timeout=60)
            return _ping(address, count)
        finally:
            for child in children:
                child.kill()
                child.join(5)


def _ping(address: str, count: int) -> list[float]:
    import time
    import zmq
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(address)
    payload = b"x" * 64
    try:
        for _ in range(50):   # warm-up: connections and handshakes
            dealer.send(payload)
            dealer.recv()
        samples = []
        for _ in range(max(1, count // 100)):
            started = time.perf_counter()
            for _ in range(100):
                dealer.send(payload)
                dealer.recv()
            samples.append((time.perf_counter() - started) / 100)
        return samples
    finally:
        context.destroy(linger=0)


def _echo(ready) -> None:
    import zmq
    router = zmq.Context().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ready.put(f"tcp://127.0.0.1:{port}")
    while True:
        router.send_multipart(router.recv_multipart())


def _proxy(front: str, back: str, ready) -> None:
    import zmq
    context = zmq.Context()
    frontend, backend = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    frontend.bind(front)
    backend.connect(back)
    ready.put("ready")
    zmq.proxy(frontend, backend)

