"""Relays for large local pools: ranks from LOCAL_RELAY_GROUP on subscribe through one relay
(runtime/processes/relay.py) per LOCAL_RELAY_GROUP ranks instead of to the controller itself.

ZeroMQ's PUB writes every subscriber its own copy of every batch, on the controller's own I/O
thread: at 64 local workers that copy is the one controller cost that grows with the pool (about
1-2 us per op on top of about 9, benchmark 12). With ranks 16-31, 32-47 and 48-63 behind three
relays, the controller has 19 subscribers instead of 64. A pool of up to 16 workers (every
default session) never starts one, so its reads keep their one hop. Replies and heartbeats still
go straight to the controller. DTORCH_RELAY=0 turns them off, as for dtorch-launch's host relays.

A relay here is a process like a worker (`python -m dtorch.runtime.processes.relay`, its config on stdin,
which stays open: its EOF, when the controller goes, ends the relay). Its loss is reported as the
loss of the workers it serves, as docs/design/launcher.md's "Relays" describes for hosts.
"""
from __future__ import annotations

import collections
import json
import secrets
import shutil
import subprocess
import sys

__all__ = ["LOCAL_RELAY_GROUP", "LocalRelays", "LocalRelay", "local_relays_enabled"]

LOCAL_RELAY_GROUP = 16
_STOP_SECONDS = 5.0


class LocalRelay:
    def __init__(self, ranks: range, config: dict, env: dict, forward_lines):
        """forward_lines(stream, prefix, tail=): cluster's copy of a process's output to ours."""
        self.ranks = ranks
        self.directory = directory = f"/tmp/dtorch-relay-{secrets.token_hex(8)}"
        self.address = f"ipc://{directory}/commands"
        self.process = subprocess.Popen([sys.executable, "-m", "dtorch.runtime.processes.relay"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        relay_config = {"upstream": config["command_address"], "curve": config.get("curve"),
                        "ranks": list(ranks), "directory": directory,
                        "controller_timeout": config.get("controller_timeout", 6.0)}
        self.process.stdin.write((json.dumps(relay_config) + "\n").encode())
        self.process.stdin.flush()
        self._tail: collections.deque = collections.deque(maxlen=1)
        forward_lines(self.process.stdout, f"[relay {ranks.start}-{ranks.stop - 1}] ", tail=self._tail)

    def loss(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        detail = f": {self._tail[-1]}" if self._tail else ""
        return (f"the local relay (pid {self.process.pid}) that carries the commands of ranks "
                f"{self.ranks.start}-{self.ranks.stop - 1} exited with code {code}{detail}")

    def stop(self) -> None:
        try:
            self.process.stdin.close()   # EOF: the relay removes its directory and exits
        except OSError:
            pass

    def wait(self) -> None:
        try:
            self.process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(_STOP_SECONDS)
        # A relay removes its own directory as it leaves; one that was killed cannot
        shutil.rmtree(self.directory, ignore_errors=True)


class LocalRelays:
    def __init__(self, enabled: bool, forward_lines):
        self.enabled, self._forward_lines = enabled, forward_lines
        self._by_group: dict[int, LocalRelay] = {}

    def route(self, rank: int, config: dict, env: dict) -> tuple[dict, LocalRelay | None]:
        """The worker's config, pointed at its group's relay when it has one (starting it)."""
        group = rank // LOCAL_RELAY_GROUP
        if not self.enabled or group == 0:
            return config, None
        relay = self._by_group.get(group)
        if relay is None or relay.loss() is not None:
            ranks = range(group * LOCAL_RELAY_GROUP, (group + 1) * LOCAL_RELAY_GROUP)
            relay = self._by_group[group] = LocalRelay(ranks, config, env, self._forward_lines)
        return {**config, "relay_address": relay.address}, relay

    def all(self) -> list[LocalRelay]:
        return list(self._by_group.values())

    def close(self) -> None:
        relays, self._by_group = list(self._by_group.values()), {}
        for relay in relays:
            relay.stop()
        for relay in relays:
            relay.wait()



def local_relays_enabled() -> bool:
    """DTORCH_RELAY, read by dtorch-launch's own switch (launcher/relays.py). A local session
    also runs from a source tree where dtorch_launcher is not installed: relays stay on there."""
    try:
        from dtorch_launcher.relays import relays_enabled
    except ImportError:
        return True
    return relays_enabled()
