"""SshSpawner through real sshd servers: config over stdin, output, env, killing, failures."""
import os
import subprocess
import sys
import time

import pytest

from dtorch_launcher import Host, SshSpawner, controller_host
from launch_helpers import TESTS_DIRECTORY, all_command_lines, process_alive, read_report, wait_gone, wait_until
from launch_sshd import free_port

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(60)]


def test_plain_ssh_reaches_each_host_on_its_own_address(sshd_hosts):
    for server in sshd_hosts.servers:
        result = subprocess.run(["ssh", "-F", str(sshd_hosts.ssh_config), "-o", "BatchMode=yes", server.name,
                                 "echo $SSH_CONNECTION"], capture_output=True, text=True, timeout=20)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[2] == server.address


def test_spawn_sends_the_config_and_learns_the_remote_pid(sshd_hosts, workers, tmp_path):
    hosts = [Host("host-a", slots=2), Host("host-b", slots=1)]
    spawner = SshSpawner(hosts, sshd_hosts.options(log_dir=str(tmp_path)))
    started = [workers.spawn(spawner, rank, {"rank": rank, "keys": {"public": "p" * 40}}) for rank in range(3)]
    addresses = {server.name: server.address for server in sshd_hosts.servers}
    for worker in started:
        report = read_report(tmp_path, worker.rank)
        assert report["config"] == {"rank": worker.rank, "keys": {"public": "p" * 40}}
        assert report["cwd"] == str(TESTS_DIRECTORY)
        assert report["ssh_connection"].split()[2] == addresses[worker.host]
        assert worker.wait_for_pid(10) == report["pid"]
        assert process_alive(worker.pid) and worker.poll() is None
    assert [worker.host for worker in started] == ["host-a", "host-a", "host-b"]


def test_output_is_prefixed_on_the_terminal_and_written_per_rank(sshd_hosts, workers, tmp_path, capsys):
    spawner = SshSpawner(sshd_hosts.hosts, sshd_hosts.options(log_dir=str(tmp_path)))
    for rank in range(2):
        workers.spawn(spawner, rank, {"stdout_lines": [f"out {rank}"], "stderr_lines": [f"err {rank}"]})
    seen = []
    expected = ["[rank 0 host-a] out 0", "[rank 0 host-a] err 0", "[rank 1 host-b] out 1", "[rank 1 host-b] err 1"]
    wait_until(lambda: seen.append(capsys.readouterr().err) or all(e in "".join(seen) for e in expected), 20)
    terminal = "".join(seen)
    assert all(line in terminal for line in expected), terminal
    assert "DTORCH_REMOTE_PID" not in terminal
    log = (tmp_path / "rank1.log").read_text()
    assert "out 1\n" in log and "err 1\n" in log and "[rank" not in log


def test_forwarded_environment_arrives_exactly(sshd_hosts, workers, tmp_path, monkeypatch):
    values = {"DTORCH_TEST_QUOTES": "it's \"$(rm -rf /)\" `x` $HOME \\n;|&", "DTORCH_TEST_SPACES": "  a  b  ",
              "DTORCH_TEST_EMPTY": ""}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DTORCH_TEST_UNSET", raising=False)
    names = [*values, "DTORCH_TEST_UNSET"]
    spawner = SshSpawner(sshd_hosts.hosts, sshd_hosts.options(log_dir=str(tmp_path), env=names))
    workers.spawn(spawner, 0, {"report_env": names})
    assert read_report(tmp_path, 0)["env"] == {**values, "DTORCH_TEST_UNSET": None}


def test_secrets_never_appear_on_a_command_line(sshd_hosts, workers, tmp_path, monkeypatch):
    monkeypatch.setenv("DTORCH_TEST_TOKEN", "env-secret-4f1c9a")
    spawner = SshSpawner(sshd_hosts.hosts, sshd_hosts.options(log_dir=str(tmp_path), env=["DTORCH_TEST_TOKEN"]))
    for rank in range(2):
        workers.spawn(spawner, rank, {"curve_secret_key": "config-secret-77e2b0", "report_env": ["DTORCH_TEST_TOKEN"]})
    assert read_report(tmp_path, 1)["env"] == {"DTORCH_TEST_TOKEN": "env-secret-4f1c9a"}
    command_lines = all_command_lines()
    assert any("echo_worker" in line for line in command_lines)
    leaks = [line for line in command_lines if "secret-" in line]
    assert not leaks


# terminate() is stdin EOF, so the worker exits cleanly and ssh reports its 0; kill() kills ssh.
@pytest.mark.parametrize("stop, exit_code", [("kill", -9), ("terminate", 0)])
def test_stopping_a_worker_ends_the_remote_process(sshd_hosts, workers, stop, exit_code):
    spawner = SshSpawner(sshd_hosts.hosts, sshd_hosts.options())
    worker = workers.spawn(spawner, 1, {})
    pid = worker.wait_for_pid(20)
    assert pid is not None and process_alive(pid)
    getattr(worker, stop)()
    assert worker.wait(10) == exit_code
    assert wait_gone(pid, 10), f"remote worker {pid} still running 10 s after {stop}()"


def test_exit_code_passes_through(sshd_hosts, workers):
    spawner = SshSpawner(sshd_hosts.hosts, sshd_hosts.options())
    worker = workers.spawn(spawner, 0, {"exit_code": 3, "stderr_lines": ["RuntimeError: boom"]})
    assert worker.wait(20) == 3
    assert worker.failure_message() == "worker on host-a exited with code 3: RuntimeError: boom"


def test_unreachable_host_fails_within_the_connect_timeout(sshd_hosts, workers):
    host = Host("127.0.0.9", port=free_port("127.0.0.9"))  # nobody listens there
    spawner = SshSpawner([host], sshd_hosts.options(connect_timeout=3))
    started = time.monotonic()
    worker = workers.spawn(spawner, 0, {})
    assert worker.wait(10) == 255
    assert time.monotonic() - started < 3 + 2
    assert worker.pid is None
    assert "connection to 127.0.0.9 refused" in worker.failure_message()


@pytest.mark.parametrize("settings, expected", [
    (dict(python="/nonexistent/python"), "python '/nonexistent/python' not found on host-b"),
    (dict(worker_module="no_such_module_for_dtorch"), f"{sys.executable} on host-b cannot import no_such_module"),
    (dict(chdir="/nonexistent/directory"), "cannot enter the working directory on host-b"),
])
def test_broken_host_setup_gives_a_clear_message(sshd_hosts, workers, settings, expected):
    spawner = SshSpawner([Host("host-b")], sshd_hosts.options(**settings))
    worker = workers.spawn(spawner, 0, {})
    assert worker.wait(20) not in (None, 0)
    assert expected in worker.failure_message()


def test_many_workers_on_one_host(sshd_hosts, workers, tmp_path):
    spawner = SshSpawner([Host("host-a", slots=8)], sshd_hosts.options(log_dir=str(tmp_path)))
    started = [workers.spawn(spawner, rank, {"rank": rank}) for rank in range(8)]
    assert sorted(read_report(tmp_path, rank)["config"]["rank"] for rank in range(8)) == list(range(8))
    pids = [worker.wait_for_pid(20) for worker in started]
    assert len(set(pids)) == 8
    for worker in started:
        worker.terminate()
    assert all(wait_gone(pid, 10) for pid in pids)
    assert os.getpid() not in pids


def test_controller_address_follows_ssh_config_aliases(sshd_hosts):
    # host-a is an alias for 127.0.0.2 in the -F file only; the route there leaves from loopback.
    assert controller_host([Host("host-a")], sshd_hosts.options()) == "127.0.0.1"
