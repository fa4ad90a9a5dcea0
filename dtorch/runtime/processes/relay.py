"""A per-host relay: one copy of the command stream per host instead of one per worker.

ZeroMQ's PUB over TCP sends every subscriber its own copy, so a controller with 4 workers on each
host sends each command 4 times to every host. dtorch-launch starts one relay on each host with
more than one slot (`python -m dtorch.runtime.processes.relay`, by launcher/relays.py); it subscribes to
the controller once (TCP, CURVE whenever the run has keys) and republishes every message,
frames unchanged, on an ipc:// socket that the host's workers subscribe to instead. Sequence
numbers and gap checks therefore stay end to end; replies and heartbeats go straight from each
worker to the controller, as without a relay (docs/design/launcher.md, "Relays").

Config: one JSON line on stdin, like a worker's (never on a command line): `upstream` (the
controller's PUB address), `curve` (the client keys workers get, or null), `ranks` (the ranks
this host runs), `directory` (a new path for the ipc socket, made here with mode 0700) and
`controller_timeout` (seconds of upstream silence before the relay gives up).

The relay exits when its stdin reaches EOF (the controller or the ssh session is gone), when
the upstream connection drops (the controller died, or went silent past the timeout: what it
published meanwhile is lost, so the workers could not go on anyway) and when the controller's
CURVE handshake refuses it. The controller reports a relay's exit as the loss of every worker
of its host; no worker ever waits on a relay that is gone.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time

from .. import protocol as wire
from ..transport import RelaySockets

__all__ = ["main", "relay_topics", "STALE_AGE_S"]

EXIT_UPSTREAM_LOST = 3        # the controller went away (as a worker's heartbeat exit)
EXIT_CANNOT_START = 2         # as worker_process.EXIT_CANNOT_START: the launcher quotes stderr
STALE_AGE_S = 60.0            # another relay's directory younger than this is never swept
QUIET_EXIT_GRACE_S = 1.0      # a lost upstream waits this long for stdin's EOF before saying so


def relay_topics(ranks) -> list[bytes]:
    """What the relay subscribes to upstream: every command, every probe, and the private
    uploads of each rank on this host (those of other hosts never reach it)."""
    return [wire.TOPIC_ALL, *(wire.topic_for_rank(rank) for rank in ranks), wire.TOPIC_PROBE]


def main() -> None:
    config = json.loads(sys.stdin.readline())
    directory = config["directory"]
    _watch_stdin(directory)
    try:
        _remove_stale_directories(os.path.dirname(directory))
        os.mkdir(directory, 0o700)   # fails if the path exists: nobody else's directory is used
        sockets = RelaySockets(config["upstream"], directory, relay_topics(config["ranks"]), config.get("curve"),
                               float(config.get("controller_timeout", 6.0)))
    except Exception as error:  # noqa: BLE001 -- any failure to start is reported the same way
        print(f"dtorch relay cannot start: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        _leave(directory, EXIT_CANNOT_START)
    threading.Thread(target=_watch_upstream, args=(sockets, directory), name="upstream-watch", daemon=True).start()
    sockets.forward()
    _leave(directory, 0)


def _watch_stdin(directory: str) -> None:
    """EOF on stdin: the controller (or the ssh session carrying us) is gone."""
    def watch():
        while sys.stdin.buffer.read(65536):
            pass
        _leave(directory, 0)
    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def _watch_upstream(sockets: RelaySockets, directory: str) -> None:
    while True:
        event = sockets.next_event()
        if event == "disconnected":
            # At a normal shutdown the controller closes its sockets, then this relay's stdin:
            # that EOF ends the process quietly (_watch_stdin) within this grace.
            time.sleep(QUIET_EXIT_GRACE_S)
            print("dtorch relay: lost the connection to the controller, exiting", file=sys.stderr, flush=True)
            _leave(directory, EXIT_UPSTREAM_LOST)
        if event == "refused":
            print("dtorch relay cannot start: the controller refused its CURVE handshake (keys of another run?)",
                  file=sys.stderr, flush=True)
            _leave(directory, EXIT_CANNOT_START)


def _leave(directory: str, code: int) -> None:
    """Remove the socket's directory and exit at once: daemon threads hold locks a normal
    interpreter exit would wait on, and ZeroMQ's context needs no orderly end here."""
    shutil.rmtree(directory, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _remove_stale_directories(parent: str) -> None:
    """This user's relay directories that a SIGKILLed relay left behind: older than STALE_AGE_S
    and with nobody listening on their socket."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith("dtorch-relay-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_uid == os.getuid() and time.time() - info.st_mtime > STALE_AGE_S and not _listening(path):
            shutil.rmtree(path, ignore_errors=True)


def _listening(directory: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.path.join(directory, "commands"))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    main()
