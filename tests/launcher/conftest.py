"""Fixtures for the launcher tests: real sshd servers on 127.0.0.2 / 127.0.0.3, and cleanup.

Two "hosts" with distinct loopback addresses (all of 127/8 is loopback on Linux), each a real
Debian sshd with a per-run host key, reached through a generated ssh_config (``ssh -F``) with
aliases host-a and host-b. Without openssh-server the ssh tests skip and say why; CI installs it
with .ci/setup_sshd.sh, so there they run. Every fixture stops what it started, also on failure.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Under --import-mode=importlib pytest does not put this folder on sys.path; the helpers need it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_tree import load_launcher_from_tree

load_launcher_from_tree()

from dtorch_launcher import Host, SshOptions, SshSpawner  # noqa: E402
from launch_helpers import TESTS_DIRECTORY, kill_if_alive, skip_or_fail, wait_gone  # noqa: E402
from launch_sshd import SshServer, can_connect, free_port, generate_keys, missing_tools, write_ssh_config  # noqa: E402

LOOPBACK_HOSTS = (("host-a", "127.0.0.2"), ("host-b", "127.0.0.3"))


@dataclass
class SshCluster:
    """Running sshd servers and the ssh_config that reaches them by alias."""

    ssh_config: Path
    servers: list[SshServer]

    @property
    def hosts(self) -> list[Host]:
        return [Host(server.name) for server in self.servers]

    def options(self, **overrides) -> SshOptions:
        """Options that start the echo stand-in worker from tests/launcher on these hosts."""
        settings = dict(python=sys.executable, chdir=str(TESTS_DIRECTORY), worker_module="echo_worker",
                        ssh_options=["-F", str(self.ssh_config)], connect_timeout=5)
        return SshOptions(**{**settings, **overrides})


@pytest.fixture(scope="session")
def ssh_keys(tmp_path_factory):
    reason = missing_tools()
    if reason:
        skip_or_fail(f"no real sshd: {reason}")
    return generate_keys(tmp_path_factory.mktemp("ssh"))


@pytest.fixture(scope="session")
def sshd_hosts(ssh_keys):
    servers = [SshServer(ssh_keys, name, address, free_port(address)) for name, address in LOOPBACK_HOSTS]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(can_connect)
        yield SshCluster(write_ssh_config(ssh_keys, servers, "loopback"), servers)
    finally:
        for server in servers:
            server.stop()


class WorkerTracker:
    """Spawns through a spawner and, at teardown, makes sure every ssh client and worker is gone."""

    def __init__(self):
        self.workers = []

    def spawn(self, spawner: SshSpawner, rank: int, config: dict, **kwargs):
        worker = spawner.spawn(rank, config, **kwargs)
        self.workers.append(worker)
        return worker

    def cleanup(self) -> None:
        for worker in self.workers:
            worker.kill()
        for worker in self.workers:
            worker.wait(5)
            # Killing ssh ends the remote worker through stdin EOF; a test that broke that must not
            # leave a process behind for the next one.
            if worker.pid is not None and not wait_gone(worker.pid, 10):
                kill_if_alive(worker.pid)


@pytest.fixture
def workers():
    tracker = WorkerTracker()
    try:
        yield tracker
    finally:
        tracker.cleanup()
