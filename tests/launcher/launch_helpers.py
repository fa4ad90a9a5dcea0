"""Small helpers shared by the launcher tests: waiting, process checks, reading echo reports."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from echo_worker import REPORT_PREFIX

TESTS_DIRECTORY = Path(__file__).resolve().parent


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; that value, or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    return bool(wait_until(lambda: not process_alive(pid), timeout))


def kill_if_alive(pid: int | None) -> None:
    if pid is not None and process_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_report(log_dir: Path, rank: int, timeout: float = 20.0) -> dict:
    """The echo worker's report for ``rank``, read from its --log-dir file."""
    path = Path(log_dir) / f"rank{rank}.log"

    def report():
        if not path.exists():
            return None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(REPORT_PREFIX):
                return json.loads(line[len(REPORT_PREFIX):])
        return None

    found = wait_until(report, timeout)
    if found is None:
        text = path.read_text(errors="replace") if path.exists() else "(no log file)"
        raise TimeoutError(f"no report from rank {rank} within {timeout}s; its log: {text}")
    return found


def all_command_lines() -> list[str]:
    """Every process's command line on this machine, as ``ps`` would show it."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass  # the process exited while we looked
    return lines


REPOSITORY = TESTS_DIRECTORY.parents[1]
# The CLI of this source tree, whether or not dtorch-launch is installed.
LAUNCH_COMMAND = [sys.executable, str(TESTS_DIRECTORY / "dtorch_launch_from_tree.py")]


def launch_mesh_script(ssh_config: Path, host_names: list[str], directory: Path, *script_args: str,
                       script: str = "mesh_over_ssh.py", slots: int = 1, env: dict | None = None):
    """Start dtorch-launch on tests/launcher/<script> (mesh_over_ssh.py) with `slots` workers per
    host (default one), `env` added to its environment.

    Returns the controller process (stdin, stdout piped as text) and its stderr file, where the
    workers' prefixed output lands.
    """
    hostfile = directory / "hosts"
    hostfile.write_text("".join(f"{name} slots={slots}\n" for name in host_names))
    stderr_path = directory / "controller.stderr"
    environment = {**os.environ, **(env or {}),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    with open(stderr_path, "w") as stderr:
        controller = subprocess.Popen(
            [*LAUNCH_COMMAND, "--hostfile", str(hostfile), "--ssh-option", f"-F {ssh_config}",
             "--chdir", str(REPOSITORY), "--log-dir", str(directory / "logs"), "--connect-timeout", "5",
             str(TESTS_DIRECTORY / script), *script_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=environment)
    return controller, stderr_path


def read_tagged_line(stream, tag: str, stderr_path: Path) -> str:
    """The rest of the next stdout line starting with ``tag``; the controller's stderr if none comes."""
    for line in stream:
        if line.startswith(tag):
            return line[len(tag):].strip()
    raise AssertionError(f"no {tag!r} line; controller stderr:\n{Path(stderr_path).read_text(errors='replace')}")


def stop_controller(controller: subprocess.Popen, worker_pids: list[int]) -> None:
    """Teardown: nothing the test started stays running, whatever happened."""
    if controller.poll() is None:
        controller.kill()
    controller.wait(10)
    for pid in worker_pids:
        if not wait_gone(pid, 10):
            kill_if_alive(pid)


def ssh_server_address(pid: int) -> str | None:
    """The sshd address a process was started through (from its SSH_CONNECTION), if any."""
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environment:
        if entry.startswith(b"SSH_CONNECTION="):
            return entry.decode().split()[2]
    return None


def skip_or_fail(reason: str) -> None:
    """Skip with the reason on a machine without the capability; in CI (.ci/run sets
    DTORCH_REQUIRE_SSH=1) a missing sshd or namespace support is a failure, never a skip."""
    import os
    import pytest
    if os.environ.get("DTORCH_REQUIRE_SSH"):
        pytest.fail(f"required by CI but unavailable: {reason}")
    pytest.skip(reason)
