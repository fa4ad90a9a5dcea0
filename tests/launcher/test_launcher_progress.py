"""StartupProgress output on a terminal and in logs; explain_ssh_failure's sentences."""
import io

import pytest

from dtorch_launcher import Host, StartupProgress, explain_ssh_failure

pytestmark = pytest.mark.timeout(60)

HOSTS = [Host("node1", slots=4), Host("node2", slots=4)]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_one_live_line():
    terminal = FakeTerminal()
    progress = StartupProgress(8, HOSTS, stream=terminal)
    for rank in range(4):
        progress.worker_started(rank, "node1")
    for rank in range(3):
        progress.worker_registered(rank, "node1")
    assert progress.status_line() == "workers 3/8 up — node1 3/4 starting, node2 0/4 waiting"
    assert terminal.getvalue().endswith("\r\x1b[Kworkers 3/8 up — node1 3/4 starting, node2 0/4 waiting")
    assert "\n" not in terminal.getvalue()
    progress.worker_registered(3, "node1")
    assert progress.status_line() == "workers 4/8 up — node1 4/4, node2 0/4 waiting"


def test_terminal_prints_failures_above_the_live_line_and_ends_with_a_newline():
    terminal = FakeTerminal()
    progress = StartupProgress(8, HOSTS, stream=terminal)
    progress.host_failed("node2", "connection to node2 refused")
    assert "\r\x1b[Knode2: failed: connection to node2 refused\n" in terminal.getvalue()
    assert progress.status_line() == "workers 0/8 up; failed: node2 — node1 0/4 waiting, node2 0/4 failed"
    progress.done()
    assert terminal.getvalue().endswith("\n")


def test_log_gets_a_line_per_finished_host_and_a_summary():
    log = io.StringIO()
    progress = StartupProgress(6, HOSTS, stream=log)
    for rank in range(6):
        progress.worker_started(rank, "node1" if rank < 4 else "node2")
        progress.worker_registered(rank, "node1" if rank < 4 else "node2")
    progress.done()
    lines = log.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "node1: 4/4 workers up", "node2: 2/2 workers up", "workers 6/6 up"]
    assert "\r" not in log.getvalue()


def test_a_smaller_run_leaves_the_last_hosts_out():
    progress = StartupProgress(3, HOSTS, stream=io.StringIO())
    assert progress.status_line() == "workers 0/3 up — node1 0/3 waiting"


def test_more_workers_than_slots_is_an_error():
    with pytest.raises(ValueError, match="9 workers do not fit the hosts' 8 slots"):
        StartupProgress(9, HOSTS, stream=io.StringIO())


# Real stderr texts, as OpenSSH 9 and the dash/bash shells print them.
@pytest.mark.parametrize("code, stderr, expected", [
    (255, "ssh: connect to host 127.0.0.9 port 22: Connection refused", "connection to node2 refused"),
    (255, "ssh: connect to host 10.1.1.1 port 22: No route to host", "no network route to node2"),
    (255, "ssh: connect to host 10.1.1.1 port 22: Connection timed out", "connecting to node2 timed out"),
    (255, "ssh: Could not resolve hostname node2: Name or service not known", "cannot resolve host name 'node2'"),
    (255, "root@node2: Permission denied (publickey).", "ssh login to node2 was refused"),
    (255, "Host key verification failed.", "host key of node2"),
    (127, "sh: 1: exec: /opt/py: not found", "python '/opt/py' not found on node2"),
    (127, "bash: line 1: /opt/py: No such file or directory", "python '/opt/py' not found on node2"),
    (1, "sh: 1: cd: can't cd to /srv/x", "cannot enter the working directory on node2"),
    (1, "bash: line 1: cd: /srv/x: No such file or directory", "cannot enter the working directory on node2"),
    (1, "/opt/py: No module named dtorch", "/opt/py on node2 cannot import dtorch.runtime.processes.worker_process"),
    (255, "Connection to node2 closed by remote host.", "ssh connection to node2 was lost"),
    (3, "Traceback (most recent call last):\n  ...\nRuntimeError: boom",
     "worker on node2 exited with code 3: RuntimeError: boom"),
    (-9, "", "worker on node2 was killed by signal 9"),
    (2, "Traceback (most recent call last):\nModuleNotFoundError: No module named 'cupy'\n\nThe above ...\n"
        "dtorch worker 3 cannot start: ImportError: 'cuda' meshes use cupy's NCCL, and cupy is not installed",
     "on node2: dtorch worker 3 cannot start: ImportError: 'cuda' meshes use cupy"),
])
def test_explain_ssh_failure(code, stderr, expected):
    assert expected in explain_ssh_failure("node2", code, stderr, python="/opt/py")
