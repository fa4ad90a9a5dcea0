"""One relay per host: the controller's commands cross the network once per host, not once per worker.

ZeroMQ's PUB over TCP sends every subscriber its own copy. On a host with more than one slot the
spawner therefore starts, with the host's first worker, one more ssh session running

    exec PYTHON -m dtorch.runtime.processes.relay

which subscribes to the controller once (TCP, CURVE when the run has keys) and republishes the
stream on an ipc:// socket in a new directory of mode 0700 on that host. The host's workers get
its address in their config (``relay_address``) and subscribe there; their replies and heartbeats
still go straight to the controller. The relay's config travels like a worker's: one JSON line
on stdin, never on a command line. DTORCH_RELAY=0 turns relays off (every worker subscribes to
the controller itself, as before). docs/design/launcher.md, "Relays".

This module knows three keys of the worker config the runtime builds (``command_address``,
``curve``, ``controller_timeout``) and adds one (``relay_address``); it imports nothing of dtorch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping

from .hostfile import Host
from .options import SshOptions

__all__ = ["ENV_RELAY", "RELAY_MODULE", "HostRelay", "Relays", "relays_enabled"]

ENV_RELAY = "DTORCH_RELAY"
RELAY_MODULE = "dtorch.runtime.processes.relay"
# Where relays make their socket directories: short enough for a unix socket path on any host,
# and the same on every POSIX machine (the controller picks the name, the host cannot tell it).
SOCKET_PARENT = "/tmp"
_STOP_SECONDS = 5.0


def relays_enabled(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ENV_RELAY, "1").strip() not in ("0", "false", "no", "off")


class HostRelay:
    """A relay running on one host for ``ranks``; ``process`` is its SshWorker-like ssh session."""

    def __init__(self, host: str, ranks: list[int], address: str, process):
        self.host, self.ranks, self.address, self.process = host, ranks, address, process

    @property
    def pid(self) -> int | None:
        return self.process.pid   # the REMOTE pid, once its shell reported it

    def poll(self) -> int | None:
        return self.process.poll()

    def loss(self) -> str | None:
        """Why the workers it serves can get no more commands (None while it runs)."""
        code = self.process.poll()
        if code is None:
            return None
        detail = self.process.last_stderr_line()
        return (f"the relay on {self.host} (pid {self.pid}) that carries the commands of ranks "
                f"{_ranks_text(self.ranks)} exited with code {code}" + (f": {detail}" if detail else ""))

    def as_dict(self) -> dict:
        return {"host": self.host, "pid": self.pid, "ranks": list(self.ranks), "alive": self.poll() is None}


class Relays:
    """The relays of one spawner, by host: started on demand, restarted if one died (a worker
    replaced after its relay's loss gets a new relay), stopped by close()."""

    def __init__(self, options: SshOptions, enabled: bool, start):
        # start(host, options, stdin_text, name) -> a process handle (SshWorker.start, in ssh.py)
        self._options = dataclasses.replace(options, worker_module=RELAY_MODULE)
        self._enabled, self._start = enabled, start
        # by user, name and port: alice@node1 and bob@node1 are two hosts (hostfile.py), and one
        # user's workers cannot enter the other's relay directory (mode 0700)
        self._by_host: dict[tuple, HostRelay] = {}

    def route(self, host: Host, ranks: list[int], config: dict, environment_text: str) -> tuple[dict, HostRelay | None]:
        """The worker's config, pointed at its host's relay when it has one (starting it)."""
        if not self._wanted(host, config):
            return config, None
        key = (host.destination, host.port)
        relay = self._by_host.get(key)
        if relay is None or relay.poll() is not None:
            relay = self._launch(host, ranks, config, environment_text)
            self._by_host[key] = relay
        return {**config, "relay_address": relay.address}, relay

    def _wanted(self, host: Host, config: dict) -> bool:
        # Only runtime workers on a TCP controller (the echo stand-in of the tests has no address).
        upstream = config.get("command_address")
        return self._enabled and host.slots > 1 and isinstance(upstream, str) and upstream.startswith("tcp://")

    def _launch(self, host: Host, ranks: list[int], config: dict, environment_text: str) -> HostRelay:
        directory = f"{SOCKET_PARENT}/dtorch-relay-{secrets.token_hex(8)}"
        relay_config = {"upstream": config["command_address"], "curve": config.get("curve"), "ranks": ranks,
                        "directory": directory, "controller_timeout": config.get("controller_timeout", 6.0)}
        process = self._start(host, self._options, environment_text + json.dumps(relay_config) + "\n", "relay")
        return HostRelay(host.name, ranks, f"ipc://{directory}/commands", process)

    def all(self) -> list[HostRelay]:
        return list(self._by_host.values())

    def close(self) -> None:
        """Stop every relay (after the workers: they exit on the Shutdown command it carried)."""
        relays, self._by_host = list(self._by_host.values()), {}
        for relay in relays:
            relay.process.terminate()   # stdin EOF: the relay removes its directory and exits
        for relay in relays:
            if relay.process.wait(_STOP_SECONDS) is None:
                relay.process.kill()
                relay.process.wait(_STOP_SECONDS)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
