"""A start that fails (a host that does not resolve, an absurd host name, ssh refused) leaves a
process that exits as Python does: 0 when the script caught the error, 1 when it did not. Never
an abort at exit (exit 134, "terminate called without an active exception": the warm-up thread
was still importing torch) and never "Task was destroyed but it is pending!" (the controller's
probe task left sleeping on a stopped loop)."""
import shutil

import pytest

from support import run_script

pytestmark = pytest.mark.timeout(300)

# The child imports dtorch_launcher from this tree (tests/launcher/launch_tree.py), installed or not.
SCRIPT = r"""
import json, os, sys, tempfile
sys.path.insert(0, "tests/launcher")
from launch_tree import load_launcher_from_tree
load_launcher_from_tree()
os.environ["DTORCH_LAUNCH_OPTIONS"] = json.dumps({"ssh_options": ["-F", "/dev/null"], "connect_timeout": 5})
import dtorch
descriptor, path = tempfile.mkstemp(prefix="dtorch-hosts-")
with os.fdopen(descriptor, "w") as file:
    file.write(HOSTS)
try:
    for _ in range(ATTEMPTS):
        if not CATCH:
            dtorch.init(hostfile=path, startup_timeout=30)
        try:
            dtorch.init(hostfile=path, startup_timeout=30)
        except Exception as error:
            print("CAUGHT", type(error).__name__, str(error)[:300], flush=True)
finally:
    os.remove(path)
"""

HOSTS = {
    "unresolvable": "node7.invalid slots=2\n",
    "100000 characters": "a" * 100_000 + " slots=2\n",
    "1000 characters": "b" * 1000 + "\n",
    "listed twice": "127.0.0.1 slots=2\nlocalhost\n",
}


def run_start(hosts: str, catch: bool, attempts: int = 1):
    source = SCRIPT.replace("HOSTS", repr(hosts)).replace("CATCH", repr(catch)).replace("ATTEMPTS", str(attempts))
    return run_script(source, timeout=120)


def assert_clean_exit(result, code: int) -> None:
    assert "terminate called" not in result.stderr, result.stderr[-2000:]
    assert "Task was destroyed" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("case", sorted(HOSTS))
def test_a_caught_start_failure_exits_0(case):
    result = run_start(HOSTS[case], catch=True)
    assert_clean_exit(result, 0)
    assert "CAUGHT HostfileError" in result.stdout, (result.stdout, result.stderr[-2000:])


def test_an_uncaught_start_failure_exits_1_with_the_hostfile_line():
    result = run_start(HOSTS["unresolvable"], catch=False)
    assert_clean_exit(result, 1)
    assert ":1: cannot resolve host 'node7.invalid'" in result.stderr, result.stderr[-2000:]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="the OpenSSH client is not installed")
def test_ssh_refused_leaves_no_pending_task():
    """Workers are spawned and the probe task runs before ssh's failure is known. Whether the
    probe still sleeps when the loop stops is a race: five starts make it likely."""
    result = run_start("127.0.0.9 slots=2 port=1\n", catch=True, attempts=5)
    assert_clean_exit(result, 0)
    assert "CAUGHT StartupError connection to 127.0.0.9 refused" in result.stdout, result.stderr[-2000:]


def test_a_controller_address_not_of_this_machine_is_named_and_nothing_is_left_running():
    """192.0.2.1 (TEST-NET-1) is no address of this machine: a StartupError naming it and what
    controller_address must be, raised before any thread starts; the script then exits 0."""
    result = run_script("""
        import threading, dtorch
        try:
            dtorch.init(num_workers=1, controller_address="192.0.2.1")
        except dtorch.StartupError as error:
            print("CAUGHT", error)
        print("THREADS", sorted(t.name for t in threading.enumerate() if t.name.startswith("dtorch")))
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CAUGHT the controller cannot listen on '192.0.2.1'" in result.stdout, result.stdout
    assert "controller_address" in result.stdout and "THREADS []" in result.stdout, result.stdout
