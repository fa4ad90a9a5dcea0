"""Two hosts with their own network stacks: sshd in each of two network namespaces on a bridge.

Closer to a real cluster than loopback aliases: each host has its own interfaces and routes, and
only the bridge connects them to the controller's side (10.77.N.1; N is 0 unless another run holds it).
"""
import json
import os
import shutil
import subprocess
import time

import pytest

from dtorch_launcher import Host, SshOptions, SshSpawner, controller_host
from launch_helpers import (TESTS_DIRECTORY, skip_or_fail, launch_mesh_script, process_alive, read_report,
                            read_tagged_line, ssh_server_address, stop_controller, wait_gone)
from launch_sshd import SshServer, can_connect, write_ssh_config

pytestmark = [pytest.mark.netns, pytest.mark.ssh, pytest.mark.timeout(60)]

NETNS_SCRIPT = TESTS_DIRECTORY / "netns.sh"
RUN_ID = str(os.getpid())


def _netns(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS_SCRIPT), *arguments], capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    """A 10.77.N /24 that no interface uses yet, so that concurrent test runs do not collide."""
    in_use = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    for third in range(0, 256):
        if f" 10.77.{third}." not in in_use:
            return f"10.77.{third}"
    skip_or_fail("every 10.77.N.0/24 subnet is in use")


@pytest.fixture(scope="module")
def netns_hosts(ssh_keys):
    if os.geteuid() != 0:
        skip_or_fail("netns tests need root (ip netns add)")
    if shutil.which("ip") is None:
        skip_or_fail("`ip` not found (install iproute2: .ci/setup_sshd.sh)")
    _netns("sweep")
    subnet = _free_subnet()
    built = _netns("up", RUN_ID, subnet)
    if built.returncode != 0:
        _netns("down", RUN_ID)
        skip_or_fail(f"cannot build network namespaces here: {built.stderr.strip()}")
    servers = [SshServer(ssh_keys, name, f"{subnet}.{octet}", 22,
                         command_prefix=("ip", "netns", "exec", f"dtorch-{RUN_ID}-{side}"))
               for name, side, octet in (("ns-a", "a", 2), ("ns-b", "b", 3))]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(can_connect)
        yield servers, write_ssh_config(ssh_keys, servers, "netns")
    finally:
        for server in servers:
            server.stop()
        _netns("down", RUN_ID)


def _options(ssh_config, **overrides):
    settings = dict(chdir=str(TESTS_DIRECTORY), worker_module="echo_worker",
                    ssh_options=["-F", str(ssh_config)], connect_timeout=5)
    return SshOptions(**{**settings, **overrides})


def test_each_namespace_is_its_own_host(netns_hosts):
    servers, ssh_config = netns_hosts
    host_namespace = os.readlink("/proc/self/ns/net")
    for server in servers:
        result = subprocess.run(
            ["ssh", "-F", str(ssh_config), "-o", "BatchMode=yes", server.name,
             "readlink /proc/self/ns/net; ip -4 -o addr show dev eth0"],
            capture_output=True, text=True, timeout=20)
        assert result.returncode == 0, result.stderr + server.log_text()
        namespace, addresses = result.stdout.split("\n", 1)
        assert namespace != host_namespace
        assert f"inet {server.address}/24" in addresses


def test_spawner_starts_and_stops_workers_in_both_namespaces(netns_hosts, workers, tmp_path):
    servers, ssh_config = netns_hosts
    spawner = SshSpawner([Host(server.name) for server in servers], _options(ssh_config, log_dir=str(tmp_path)))
    started = [workers.spawn(spawner, rank, {"rank": rank}) for rank in range(2)]
    for worker, server in zip(started, servers):
        report = read_report(tmp_path, worker.rank)
        assert report["ssh_connection"].split()[::2] == [_bridge_address(server), server.address]
        assert process_alive(worker.wait_for_pid(10))
    for worker in started:
        worker.kill()
        assert wait_gone(worker.pid, 10)


def test_silent_host_fails_after_the_connect_timeout(netns_hosts, workers):
    servers, ssh_config = netns_hosts
    # On the bridge's subnet, but nobody answers: packets vanish instead of being refused.
    silent = servers[0].address.rsplit(".", 1)[0] + ".99"
    spawner = SshSpawner([Host(silent)], _options(ssh_config, connect_timeout=2))
    started = time.monotonic()
    worker = workers.spawn(spawner, 0, {})
    assert worker.wait(15) == 255
    assert time.monotonic() - started < 2 + 3
    message = worker.failure_message()
    assert silent in message and ("timed out" in message or "no network route" in message), message


def test_controller_address_is_the_bridge_side(netns_hosts):
    servers, ssh_config = netns_hosts
    assert controller_host([Host("ns-b")], _options(ssh_config)) == _bridge_address(servers[1])


@pytest.mark.slow
def test_mesh_across_namespaces_matches_torch(netns_hosts, tmp_path):
    """Workers in two network stacks reach the controller (on the bridge, CURVE on) and each other."""
    servers, ssh_config = netns_hosts
    controller, stderr_path = launch_mesh_script(ssh_config, [s.name for s in servers], tmp_path)
    pids = []
    try:
        pids = [w["pid"] for w in json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))]
        assert [ssh_server_address(pid) for pid in pids] == [server.address for server in servers]
        assert read_tagged_line(controller.stdout, "OK", stderr_path) == ""
        assert controller.wait(20) == 0, stderr_path.read_text()
    finally:
        stop_controller(controller, pids)


@pytest.mark.slow
def test_relays_across_namespaces_use_curve_upstream(netns_hosts, tmp_path):
    """Two workers per namespace: one relay in each, subscribed to the controller's CURVE-only
    PUB (its ZAP handler admits the run's client key alone), the workers behind it on ipc."""
    servers, ssh_config = netns_hosts
    controller, stderr_path = launch_mesh_script(ssh_config, [s.name for s in servers], tmp_path,
                                                 script="relay_over_ssh.py", slots=2)
    pids = []
    try:
        workers = json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))
        relays = json.loads(read_tagged_line(controller.stdout, "RELAYS ", stderr_path))
        pids = [w["pid"] for w in workers] + [r["pid"] for r in relays]
        assert json.loads(read_tagged_line(controller.stdout, "SESSION ", stderr_path))["curve"] is True
        assert [ssh_server_address(r["pid"]) for r in relays] == [server.address for server in servers]
        assert read_tagged_line(controller.stdout, "OK", stderr_path) == ""
        assert controller.wait(20) == 0, stderr_path.read_text()
        assert all(wait_gone(pid, 10) for pid in pids)
    finally:
        stop_controller(controller, pids)


def _bridge_address(server: SshServer) -> str:
    return server.address.rsplit(".", 1)[0] + ".1"
