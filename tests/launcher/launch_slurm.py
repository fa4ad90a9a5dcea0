"""A real SLURM cluster on this machine for the tests: one slurmctld and two slurmd nodes.

Debian's slurm-wlm (22.05) allows several slurmd per host: each runs with ``-N node1`` /
``-N node2`` on a port of its own, and slurm.conf gives the nodes the loopback addresses
127.0.0.2 and 127.0.0.3 (all of 127/8 is loopback), so an allocation of ``-N2`` spans two
"nodes" whose steps srun reaches over TCP like on a cluster. Every run writes its own slurm.conf
with free ports and a state directory under the test's tmp folder, so runs never share state;
only munged (a system daemon, started by .ci/setup_slurm.sh) is shared. Clients find the cluster
through SLURM_CONF in ``environment()``.

Every daemon carries DTORCH_SLURM_TEST=<folder> in its environment, which slurmstepd inherits from
slurmd: stop() ends the jobs, then the daemons, then any process still carrying the marker.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from launch_helpers import kill_if_alive, process_alive, wait_until
from launch_sshd import free_port

NODES = (("node1", "127.0.0.2"), ("node2", "127.0.0.3"))
CPUS_PER_NODE = 2
_TOOLS = ("slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "munge",
          "unmunge")
_MARKER = "DTORCH_SLURM_TEST"
_ANY = "0.0.0.0"   # the daemons listen on every address


def missing_slurm() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}): run .ci/setup_slurm.sh"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps"
    credential = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True, timeout=20)
    if credential.returncode != 0:
        return f"munged is not running ({credential.stderr.strip()[:200]}): run .ci/setup_slurm.sh"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.conf = self.folder / "slurm.conf"
        self.processes: list[subprocess.Popen] = []

    def environment(self, **extra: str) -> dict[str, str]:
        """This process's environment with SLURM_CONF naming this cluster (and no job of ours)."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**inherited, "SLURM_CONF": str(self.conf), **extra}

    def start(self, timeout: float = 60.0) -> None:
        self._write_conf()
        daemon_env = self.environment(**{_MARKER: str(self.folder)})
        log = open(self.folder / "daemons.log", "ab")
        # -D: stay in the foreground, so these Popen objects are the daemons themselves.
        commands = [[_daemon("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)],
                    *[[_daemon("slurmd"), "-D", "-N", name, "-f", str(self.conf)] for name, _ in NODES]]
        for command in commands:
            self.processes.append(subprocess.Popen(command, env=daemon_env, stdout=log, stderr=log,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
            if command[0].endswith("slurmctld"):
                wait_until(lambda: self._run("scontrol", "ping").returncode == 0, timeout, 0.2)
        if not wait_until(self.nodes_idle, timeout, 0.5):
            raise RuntimeError(f"the SLURM nodes did not come up within {timeout}s:\n{self.log_tail()}")

    def nodes_idle(self) -> bool:
        states = self._run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split("\n")
        idle = [line for line in states if line.strip().endswith("idle")]
        return len(idle) == len(NODES)

    def jobs(self) -> list[str]:
        return self._run("squeue", "--noheader", "--format=%i").stdout.split()

    def steps(self) -> list[str]:
        return self._run("squeue", "--noheader", "--steps", "--format=%i %j %N").stdout.strip().splitlines()

    def wait_no_jobs(self, timeout: float = 30.0) -> bool:
        return bool(wait_until(lambda: not self.jobs(), timeout, 0.2))

    def stop(self) -> None:
        """End every job, then the daemons, then whatever still carries this cluster's marker."""
        if self.processes and self.processes[0].poll() is None:
            self._run("scancel", "--full", "--user=root")   # every job on this cluster is ours
            self.wait_no_jobs(20)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        for pid in self.marked_processes():
            kill_if_alive(pid)

    def marked_processes(self) -> list[int]:
        """Live processes started by this cluster's daemons (slurmstepd inherits their environment)."""
        needle = f"{_MARKER}={self.folder}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if needle in (entry / "environ").read_bytes().split(b"\0") and process_alive(int(entry.name)):
                        found.append(int(entry.name))
                except OSError:
                    pass  # exited meanwhile, or not ours to read
        return found

    def log_tail(self, lines: int = 40) -> str:
        path = self.folder / "daemons.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _run(self, *command: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, env=self.environment(), capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired as error:
            return subprocess.CompletedProcess(command, 124, "", str(error))

    def _write_conf(self) -> None:
        state, spool = self.folder / "state", self.folder / "spool"
        state.mkdir(parents=True, exist_ok=True)
        for name, _ in NODES:
            (spool / name).mkdir(parents=True, exist_ok=True)
        node_lines = [f"NodeName={name} NodeAddr={address} NodeHostname={name} CPUs={CPUS_PER_NODE} "
                      f"Port={free_port(_ANY)} State=UNKNOWN" for name, address in NODES]
        settings = {
            "ClusterName": "dtorchtest",
            "SlurmctldHost": f"{socket.gethostname()}(127.0.0.1)",   # must name this host
            "SlurmctldPort": free_port(_ANY),
            "SlurmUser": "root", "SlurmdUser": "root",
            "AuthType": "auth/munge", "CredType": "cred/munge",
            "StateSaveLocation": state, "SlurmdSpoolDir": f"{spool}/%n",
            "SlurmctldPidFile": self.folder / "slurmctld.pid", "SlurmdPidFile": f"{self.folder}/slurmd-%n.pid",
            "SlurmctldLogFile": self.folder / "slurmctld.log", "SlurmdLogFile": f"{self.folder}/slurmd-%n.log",
            # No cgroups in containers: track a job's processes by their parent chain.
            "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
            "SwitchType": "switch/none", "MpiDefault": "none",
            "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
            "SchedulerType": "sched/builtin",
            "JobAcctGatherType": "jobacct_gather/none", "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "ReturnToService": 2,
            # Two nodes of CPUS_PER_NODE CPUs on one machine: slurmd must take the config's word.
            "SlurmdParameters": "config_overrides",
            "KillWait": 5, "InactiveLimit": 0, "MessageTimeout": 10, "MinJobAge": 2,
        }
        lines = [f"{key}={value}" for key, value in settings.items()] + node_lines
        lines.append(f"PartitionName=debug Nodes={','.join(name for name, _ in NODES)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")


def wait_all_gone(pids, timeout: float) -> list[int]:
    """The pids still running after ``timeout`` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if process_alive(pid)]
        if left:
            time.sleep(0.1)
    return [pid for pid in left if process_alive(pid)]
