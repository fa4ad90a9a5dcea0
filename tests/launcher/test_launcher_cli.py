"""dtorch-launch: runs the script in-process as __main__, hands the options over in the environment."""
import json
import os
import shutil
import signal
import subprocess
import textwrap

import pytest

from dtorch_launcher import ENV_CONTROLLER_ADDRESS, ENV_HOSTFILE, SshOptions
from launch_helpers import LAUNCH_COMMAND as LAUNCH
from launch_helpers import TESTS_DIRECTORY, kill_if_alive, read_report, wait_gone

pytestmark = pytest.mark.timeout(60)

SHOW_ENVIRONMENT = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                      "environ": {k: v for k, v in os.environ.items() if k.startswith("DTORCH_")}}))
""")


def launch(*arguments, cwd=None, **kwargs):
    return subprocess.run([*LAUNCH, *map(str, arguments)], capture_output=True, text=True, timeout=30,
                          cwd=cwd, **kwargs)


def test_without_hostfile_it_runs_the_script_like_python(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW_ENVIRONMENT)
    result = launch(script, "--lr", "0.1", "data")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["name"] == "__main__"
    assert shown["argv"] == [str(script), "--lr", "0.1", "data"]
    assert shown["path0"] == str(tmp_path)
    assert ENV_HOSTFILE not in shown["environ"]


def test_options_reach_the_script_environment(tmp_path):
    script, hostfile = tmp_path / "show.py", tmp_path / "hosts"
    script.write_text(SHOW_ENVIRONMENT)
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    (tmp_path / "ssh_config").write_text("")
    # the hosts are reached through the jump host, which resolves their names (not this machine)
    result = launch("--hostfile", "hosts", "--python", "/opt/py/bin/python", "--chdir", "/srv/run",
                    "--env", "HF_TOKEN", "--env", "NCCL_DEBUG", "--ssh-option", "-F ssh_config",
                    "--ssh-option", "-o ProxyJump=gateway", "--log-dir", "logs",
                    "--controller-address", "tcp://10.0.0.1:5555", "--connect-timeout", "3",
                    "show.py", "--hostfile", "not-ours", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["argv"] == ["show.py", "--hostfile", "not-ours"]
    environ = shown["environ"]
    assert environ[ENV_HOSTFILE] == str(hostfile)
    assert environ[ENV_CONTROLLER_ADDRESS] == "tcp://10.0.0.1:5555"
    assert SshOptions.from_environment(environ) == SshOptions(
        python="/opt/py/bin/python", chdir="/srv/run", env=["HF_TOKEN", "NCCL_DEBUG"],
        ssh_options=["-F", "ssh_config", "-o", "ProxyJump=gateway"], log_dir=str(tmp_path / "logs"),
        connect_timeout=3.0)


@pytest.mark.parametrize("arguments, message", [
    (["--hostfile", "hosts"], "hosts:2: slots must be a positive integer"),
    (["--hostfile", "missing"], "No such file or directory"),
    (["--env", "A=1"], "not environment variable names"),
    (["--connect-timeout", "0"], "connect_timeout"),
])
def test_bad_arguments_fail_before_the_script_runs(tmp_path, arguments, message):
    (tmp_path / "hosts").write_text("node1\nnode2 slots=0\n")
    (tmp_path / "show.py").write_text("print('ran')")
    result = launch(*arguments, "show.py", cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "ran" not in result.stdout


@pytest.mark.parametrize("hosts, message", [
    ("127.0.0.1 slots=2\nlocalhost port=22\n", "hosts:2: localhost is the same host as line 1 ('127.0.0.1 slots=2')"),
    ("127.0.0.1\nnode7.invalid\n", "hosts:2: cannot resolve host 'node7.invalid'"),
])
def test_hosts_that_cannot_work_fail_before_the_script_runs(tmp_path, hosts, message):
    (tmp_path / "hosts").write_text(hosts)
    (tmp_path / "show.py").write_text("print('ran')")
    result = launch("--hostfile", "hosts", "--ssh-option", "-F /dev/null", "show.py", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr and "ran" not in result.stdout


def test_script_exit_code_and_exceptions_propagate(tmp_path):
    (tmp_path / "exits.py").write_text("import sys; sys.exit(7)")
    (tmp_path / "raises.py").write_text("raise RuntimeError('from the script')")
    assert launch(tmp_path / "exits.py").returncode == 7
    result = launch(tmp_path / "raises.py")
    assert result.returncode == 1 and "RuntimeError: from the script" in result.stderr


def test_missing_script(tmp_path):
    result = launch(tmp_path / "nope.py")
    assert result.returncode != 0 and "no such script" in result.stderr


@pytest.mark.ssh
def test_controller_sigkill_ends_remote_workers(sshd_hosts, tmp_path):
    """The chain the runtime will use: dtorch-launch -> environment -> SshSpawner -> workers."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("host-a slots=2\nhost-b slots=1\n")
    controller = subprocess.Popen(
        [*LAUNCH, "--hostfile", hostfile, "--ssh-option", f"-F {sshd_hosts.ssh_config}",
         "--chdir", TESTS_DIRECTORY, "--worker-module", "echo_worker", "--log-dir", tmp_path / "logs",
         TESTS_DIRECTORY / "spawning_controller.py", "first-arg"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = []
    try:
        line = controller.stdout.readline()
        assert line.startswith("STARTED "), line + controller.stderr.read()
        started = json.loads(line[len("STARTED "):])
        assert [(w["rank"], w["host"]) for w in started] == [(0, "host-a"), (1, "host-a"), (2, "host-b")]
        assert read_report(tmp_path / "logs", 2)["config"] == {"rank": 2, "argv": ["first-arg"]}
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        for worker in started:
            assert wait_gone(worker["pid"], 10), f"worker {worker} outlived its controller by 10 s"
            assert wait_gone(worker["ssh_pid"], 10), f"ssh client of {worker} outlived its controller"
    finally:
        controller.kill()
        controller.wait(10)
        for worker in started:
            kill_if_alive(worker["ssh_pid"])
            kill_if_alive(worker["pid"])


@pytest.mark.ssh
def test_controller_shutdown_waits_for_clean_worker_exits(sshd_hosts, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("host-a\nhost-b\n")
    result = subprocess.run(
        [*LAUNCH, "--hostfile", hostfile, "--ssh-option", f"-F {sshd_hosts.ssh_config}", "--chdir",
         TESTS_DIRECTORY, "--worker-module", "echo_worker", TESTS_DIRECTORY / "spawning_controller.py"],
        input="", capture_output=True, text=True, timeout=40, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr
    assert "[rank 0 host-a] ECHO " in result.stderr and "[rank 1 host-b] ECHO " in result.stderr
    assert result.stdout.splitlines()[-1] == "EXITED [0, 0]"
    assert "[rank 1 host-b] stdin closed, exiting" in result.stderr


def test_installed_entry_point_runs(tmp_path):
    entry_point = shutil.which("dtorch-launch")
    if entry_point is None:
        pytest.skip("dtorch-launch is not installed (pip install -e .); the tree's CLI is tested above")
    (tmp_path / "hello.py").write_text("import sys; print('hello', sys.argv[1:])")
    result = subprocess.run([entry_point, str(tmp_path / "hello.py"), "x"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello ['x']\n"
