"""Start workers inside a SLURM allocation (salloc or sbatch): one ``srun`` job step per worker.

The allocation comes from SLURM's environment: SLURM_JOB_ID, SLURM_JOB_NODELIST (expanded with
``scontrol show hostnames``) and SLURM_TASKS_PER_NODE ("2(x3),1"). One worker per task; ranks
fill the nodes in order, and a rank's local rank is its place on its node (``cuda:<local rank>``).

Worker ``rank`` on ``node`` is one local ``srun`` process running one task:

    srun --jobid=J --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE --exact --overlap
         --cpus-per-task=C --chdir=DIR --job-name=dtorch-rank<R> PYTHON -m dtorch.runtime.processes.worker_process

Why one step per worker rather than one step for all tasks: the runtime supervises, stops and
replaces workers one rank at a time (poll, kill, replace_lost_workers, a pool that grows), and a
step per rank gives each of those a process of its own, an exact exit code per rank, and a stdin
per rank. The worker's config (the run's secret, CURVE keys) travels on that stdin, never on a
command line, in a file or in the environment; srun forwards it to the step's one task, and keeps
it open: when the controller exits or dies (even SIGKILL), the task's stdin reaches EOF and the
worker exits, as over ssh. SIGKILL of the srun process itself ends its task too (slurmstepd
loses the step's I/O connection). The cost is one step creation per worker at slurmctld and one
srun process per worker on the controller's machine, as dtorch-launch --hostfile has one ssh
process per worker; beyond a few hundred workers one step per node would be the next step.

``--exact`` gives a step only the CPUs it asks for and ``--overlap`` lets the steps (and the
batch script) share the job's resources, so that N one-task steps always fit in an N-task job,
whatever memory or GRES policy the cluster applies per step. srun exports this process's
environment to the task (``--export=ALL``, srun's default), so ``--env`` is not needed here.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .addresses import address_toward
from .hostfile import Host
from .options import SshOptions
from .output import OutputForwarder
from .ssh import SshSpawner, SshWorker

__all__ = ["ENV_SLURM", "Allocation", "SlurmError", "SlurmSpawner", "SlurmWorker", "expand_nodelist",
           "explain_srun_failure", "parse_tasks_per_node", "slurm_controller_address",
           "slurm_spawner_from_environment", "srun_command"]

ENV_SLURM = "DTORCH_SLURM"     # "1": dtorch-launch --slurm asked for srun workers
_SCONTROL_SECONDS = 30
_REPEATED = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmError(ValueError):
    """The SLURM allocation cannot be read or used; the message says what is missing."""


@dataclass(frozen=True)
class Allocation:
    """The nodes of a SLURM job and how many tasks (workers) each one runs, in rank order."""

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    cpus_per_task: int | None = None    # SLURM_CPUS_PER_TASK when the job set it

    @property
    def size(self) -> int:
        return sum(self.tasks_per_node)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, expand=None) -> Allocation:
        """Read the allocation this process runs in; SlurmError outside salloc / sbatch."""
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise SlurmError("not inside a SLURM allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST are not set): "
                             "run under salloc or in an sbatch script, e.g. salloc -N2 -n8 dtorch-launch --slurm "
                             "script.py")
        nodes = tuple((expand or expand_nodelist)(nodelist))
        text = environ.get("SLURM_TASKS_PER_NODE")
        tasks = parse_tasks_per_node(text, len(nodes)) if text else [1] * len(nodes)
        return cls(job_id, nodes, tuple(tasks), _positive(environ.get("SLURM_CPUS_PER_TASK")))


def parse_tasks_per_node(text: str, node_count: int) -> list[int]:
    """SLURM's compressed counts, "2(x3),1" -> [2, 2, 2, 1], checked against the node count."""
    counts: list[int] = []
    for part in text.split(","):
        match = _REPEATED.match(part.strip())
        if not match:
            raise SlurmError(f"SLURM_TASKS_PER_NODE={text!r} is not of the form '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != node_count:
        raise SlurmError(f"SLURM_TASKS_PER_NODE={text!r} gives {len(counts)} nodes, the node list {node_count}")
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """``scontrol show hostnames``: "node[1-3],gpu7" -> ["node1", "node2", "node3", "gpu7"]."""
    return _scontrol("show", "hostnames", nodelist).split()


def slurm_controller_address(allocation: Allocation) -> str:
    """This machine's address on the route to the first node (its own address under sbatch)."""
    return address_toward(_node_address(allocation.nodes[0]))


def _node_address(node: str) -> str:
    # NodeAddr is how SLURM itself reaches the node; node names need not resolve anywhere else.
    match = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "--oneliner", node))
    address = match.group(1) if match else node
    try:
        return socket.getaddrinfo(address, None, type=socket.SOCK_DGRAM)[0][4][0]
    except OSError as error:
        raise SlurmError(f"cannot resolve {node}'s address {address!r} to choose the address workers connect "
                         f"back to: {error}; pass --controller-address") from None


def _scontrol(*arguments: str) -> str:
    try:
        result = subprocess.run(["scontrol", *arguments], capture_output=True, text=True, timeout=_SCONTROL_SECONDS)
    except FileNotFoundError:
        raise SlurmError("`scontrol` is not installed on this machine: dtorch-launch --slurm needs SLURM's "
                         "client commands (Debian: apt-get install slurm-client)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(arguments)} did not answer within {_SCONTROL_SECONDS}s: is "
                         "slurmctld reachable?") from None
    if result.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(arguments)} failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


class SlurmSpawner(SshSpawner):
    """Starts worker ``rank`` as a one-task srun step on its node; ranks fill the nodes' tasks in
    order (the hostfile logic of SshSpawner, with one "host" per node and slots = its tasks)."""

    def __init__(self, allocation: Allocation, options: SshOptions | None = None):
        super().__init__([Host(node, slots=tasks) for node, tasks in zip(allocation.nodes, allocation.tasks_per_node)],
                         options)
        self.allocation = allocation

    @property
    def capacity_advice(self) -> str:
        return (f"SLURM job {self.allocation.job_id} has {self.capacity} tasks: ask salloc / sbatch for more "
                "(-n, --ntasks-per-node)")

    def spawn(self, rank: int, config: dict, environ: Mapping[str, str] | None = None) -> SlurmWorker:
        host = self._slot(rank)[0]
        # The job said how many CPUs a task has: use them all, unless the user chose a count
        # (dtorch.init(threads_per_worker=...), DTORCH_THREADS).
        if self.allocation.cpus_per_task and not config.get("threads_chosen"):
            config = {**config, "threads": self.allocation.cpus_per_task}
        return SlurmWorker.start_step(rank, host, self.options, self.allocation, json.dumps(config) + "\n")


class SlurmWorker(SshWorker):
    """A worker in its own srun step: the SshWorker surface, on the local srun process.

    terminate() closes stdin (the worker exits, srun delivers its last output and exit code);
    kill() also SIGKILLs srun, which ends the step's task. ``pid`` stays None: the worker's pid
    arrives with its registration."""

    @classmethod
    def start_step(cls, rank: int, host: Host, options: SshOptions, allocation: Allocation,
                   stdin_text: str) -> SlurmWorker:
        log_path = os.path.join(options.log_dir, f"rank{rank}.log") if options.log_dir else None
        output = OutputForwarder(rank, host.name, log_path)
        # A new session: a Ctrl-C in the terminal reaches only the controller (srun would turn it
        # into a signal for its task), which then stops the workers in order.
        try:
            process = subprocess.Popen(srun_command(allocation, host.name, rank, options), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except FileNotFoundError:
            raise SlurmError("`srun` is not installed on this machine (Debian: apt-get install slurm-client)") from None
        output.follow(process.stdout, process.stderr)
        worker = cls(rank, host, options, process, output)
        worker.job_id = allocation.job_id
        worker._send(stdin_text)
        return worker

    def failure_message(self) -> str | None:
        code = self._process.poll()
        if code is None or code == 0:
            return None
        self._output.join(2.0)
        return explain_srun_failure(self.rank, self.host, self.job_id, code, self._output.stderr_tail,
                                    self._options.python, self._options.worker_module)

    def __repr__(self) -> str:
        return f"SlurmWorker(rank={self.rank}, node={self.host!r}, job={self.job_id}, returncode={self.poll()})"


def srun_command(allocation: Allocation, node: str, rank: int, options: SshOptions) -> list[str]:
    """The argv of one worker's step. Every count is explicit: srun would otherwise take the
    job's SLURM_NTASKS / SLURM_NNODES / SLURM_NTASKS_PER_NODE from the environment."""
    return ["srun", f"--jobid={allocation.job_id}", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
            f"--nodelist={node}", "--exact", "--overlap", f"--cpus-per-task={allocation.cpus_per_task or 1}",
            f"--chdir={options.chdir}", f"--job-name=dtorch-rank{rank}",
            options.python, "-m", options.worker_module]


def explain_srun_failure(rank: int, node: str, job_id: str, code: int, stderr_tail: str, python: str,
                         module: str) -> str:
    """One sentence naming the rank, the node and the cause, from srun's exit code and last lines."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    where = f"worker rank {rank} on {node} (srun step of SLURM job {job_id})"
    if any("execve" in line for line in lines):
        return f"{where}: python {python!r} not found on {node}: pass --python with its path there"
    if any("No module named" in line for line in lines):
        return (f"{where}: {python} cannot import {module}: install dtorch for that python, or --chdir to a "
                "checkout")
    slurm_lines = [line for line in lines if line.startswith(("srun:", "slurmstepd:"))]
    cause = (slurm_lines or lines or ["no output"])[-1]
    return f"{where} exited with code {code}: {cause}"


def slurm_spawner_from_environment(environ: Mapping[str, str] | None = None) -> SlurmSpawner | None:
    """The spawner dtorch-launch --slurm asked for (DTORCH_SLURM=1), or None."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_SLURM) != "1":
        return None
    return SlurmSpawner(Allocation.from_environment(environ), SshOptions.from_environment(environ))


def _positive(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() and int(text) > 0 else None
