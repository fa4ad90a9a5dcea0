"""Start workers on other machines with the system OpenSSH client.

Each worker is one local ``ssh`` process running, on its host,

    cd DIR || exit 1; echo DTORCH_REMOTE_PID=$$; <read env lines>;
    exec PYTHON -m dtorch.runtime.processes.worker_process

Using the real ``ssh`` (not a Python ssh library) means ~/.ssh/config, keys, agents, ProxyJump
and ports all work as they do for the user. ``-o BatchMode=yes`` makes it fail instead of
prompting. The remote command is run by the user's login shell, which must be POSIX (sh, bash,
dash, zsh, ksh).

What crosses the channel's stdin, in order: one ``NAME=value`` line per forwarded environment
variable, an empty line, then the worker's one-line JSON config. Nothing secret is ever on a
command line (``ps`` shows command lines to every user on both machines). The stdin stays open:
when the controller dies or kills the ssh client, the worker's stdin reaches EOF and it exits, so
no signal has to cross ssh.

On a host with several slots, the host's first spawn also starts its relay (relays.py), and
the workers there subscribe to it instead of to the controller; SshSpawner.close() stops relays.
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence

from .addresses import controller_host
from .failures import explain_ssh_failure
from .host_identity import load_hostfile
from .hostfile import Host
from .options import ENV_HOSTFILE, SshOptions
from .output import PID_MARKER, OutputForwarder
from .relays import Relays, relays_enabled

# SshOptions and controller_host are re-exported: the runtime takes everything ssh from here.
__all__ = ["SshOptions", "SshSpawner", "SshWorker", "controller_host", "remote_command",
           "spawner_from_environment", "ssh_command"]

# Reads NAME=value lines until an empty one. `read` takes a pipe byte by byte, so the config line
# after the empty line is left for python. `export "$line"` assigns without evaluating the value.
_READ_ENVIRONMENT = 'while IFS= read -r dtorch_env && [ -n "$dtorch_env" ]; do export "$dtorch_env"; done'
_OUTPUT_DRAIN_SECONDS = 2.0


class SshSpawner:
    """Starts worker ``rank`` on its host; ranks fill the hosts' slots in hostfile order."""

    def __init__(self, hosts: Sequence[Host], options: SshOptions | None = None, relay: bool | None = None):
        """relay: one relay per host with several slots (launcher/relays.py); default: on,
        unless DTORCH_RELAY=0."""
        if not hosts:
            raise ValueError("SshSpawner needs at least one host")
        self.hosts = list(hosts)
        self.options = options if options is not None else SshOptions()
        # where each host's ranks start: slots are counted, never one entry each (slots=999999999
        # in a hostfile once made ~100 GB of tuples)
        self._starts = list(itertools.accumulate((host.slots for host in self.hosts), initial=0))
        start_relay = lambda host, options, text, name: SshWorker.start(-1, host, options, text, name)  # noqa: E731
        self._relays = Relays(self.options, relays_enabled() if relay is None else relay, start_relay)

    @property
    def capacity(self) -> int:
        return self._starts[-1]

    def host_for(self, rank: int) -> str:
        return self._slot(rank)[0].name

    def local_rank(self, rank: int) -> int:
        """The slot of ``rank`` on its host: 0..slots-1, e.g. to pick ``cuda:<local_rank>``."""
        return self._slot(rank)[1]

    def spawn(self, rank: int, config: dict, environ: Mapping[str, str] | None = None) -> SshWorker:
        host = self._slot(rank)[0]
        environment_text = environment_lines(self.options.env, environ)
        config, relay = self._relays.route(host, self.ranks_on(host), config, environment_text)
        worker = SshWorker.start(rank, host, self.options, environment_text + json.dumps(config) + "\n")
        worker.relay = relay
        return worker

    def ranks_on(self, host: Host) -> list[int]:
        index = next(i for i, known in enumerate(self.hosts) if known is host)
        return list(range(self._starts[index], self._starts[index + 1]))

    def relays(self) -> list[dict]:
        """host, pid (remote), ranks and alive of each relay started so far."""
        return [relay.as_dict() for relay in self._relays.all()]

    def close(self) -> None:
        """Stop the relays; the runtime calls it after its workers are stopped."""
        self._relays.close()

    def _slot(self, rank: int) -> tuple[Host, int]:
        if not 0 <= rank < self.capacity:
            raise IndexError(f"rank {rank} is outside the hostfile's {self.capacity} slots "
                             f"({', '.join(f'{h.name} slots={h.slots}' for h in self.hosts)})")
        index = bisect.bisect_right(self._starts, rank) - 1
        return self.hosts[index], rank - self._starts[index]


class SshWorker:
    """A worker running on another host; the same surface as a local worker handle.

    ``pid`` is the REMOTE worker's pid once its shell has reported it (None before that, or if
    the start failed). poll/wait act on the local ssh client, which exits with the worker's exit
    code (255 for ssh's own failures). terminate() closes the worker's stdin, a graceful stop;
    kill() also kills the ssh client, and the lost connection gives the worker its stdin EOF.
    """

    def __init__(self, rank: int, host: Host, options: SshOptions, process: subprocess.Popen,
                 output: OutputForwarder):
        self.rank, self.host = rank, host.name
        self._options, self._process, self._output = options, process, output

    relay = None   # the host's relay (launcher/relays.py) that carries this worker's commands, if any

    @classmethod
    def start(cls, rank: int, host: Host, options: SshOptions, stdin_text: str,
              name: str | None = None) -> SshWorker:
        """name: what to call a process that is not a rank (a relay) in output and log names."""
        log_name = f"{name}-{host.name}" if name else f"rank{rank}"
        log_path = os.path.join(options.log_dir, f"{log_name}.log") if options.log_dir else None
        output = OutputForwarder(rank, host.name, log_path, name)
        # A new session: a Ctrl-C in the controller's terminal must reach only the controller,
        # which then shuts the workers down in order, instead of killing every ssh client at once.
        try:
            process = subprocess.Popen(ssh_command(host, options), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True)
        except FileNotFoundError:
            raise FileNotFoundError("the OpenSSH client `ssh` is not installed on this machine "
                                    "(Debian: apt-get install openssh-client)") from None
        output.follow(process.stdout, process.stderr)
        worker = cls(rank, host, options, process, output)
        worker._send(stdin_text)
        return worker

    @property
    def pid(self) -> int | None:
        return self._output.remote_pid

    @property
    def ssh_pid(self) -> int:
        return self._process.pid

    def wait_for_pid(self, timeout: float | None = None) -> int | None:
        """Block until the remote shell reported the worker's pid; None on timeout or failure."""
        self._output.pid_known.wait(timeout)
        return self.pid

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._output.join(_OUTPUT_DRAIN_SECONDS)
        return code

    def terminate(self) -> None:
        # Only stdin EOF: the worker exits on it, and ssh stays to deliver its last output and exit
        # code. Over a dead network nothing arrives; callers follow with wait(timeout) and kill().
        self._close_stdin()

    def kill(self) -> None:
        self._close_stdin()
        if self._process.poll() is None:
            self._process.kill()

    def relay_lost(self) -> str | None:
        """Why no more commands can reach this worker: its host's relay is gone (None otherwise)."""
        return self.relay.loss() if self.relay is not None else None

    def last_stderr_line(self) -> str:
        self._output.join(_OUTPUT_DRAIN_SECONDS)
        lines = [line.strip() for line in self._output.stderr_tail.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def failure_message(self) -> str | None:
        """A sentence naming the host and the cause, once the worker exited with an error."""
        code = self._process.poll()
        if code is None or code == 0:
            return None
        self._output.join(_OUTPUT_DRAIN_SECONDS)
        return explain_ssh_failure(self.host, code, self._output.stderr_tail,
                                   self._options.python, self._options.worker_module)

    def _send(self, text: str) -> None:
        try:
            self._process.stdin.write(text.encode("utf-8", errors="surrogateescape"))
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # ssh already exited; poll() and failure_message() say why

    def _close_stdin(self) -> None:
        try:
            self._process.stdin.close()
        except OSError:
            pass  # the pipe broke because ssh is gone, which is what closing it is for

    def __repr__(self) -> str:
        return f"SshWorker(rank={self.rank}, host={self.host!r}, pid={self.pid}, returncode={self.poll()})"


def ssh_command(host: Host, options: SshOptions) -> list[str]:
    """The local argv: user options first, because ssh keeps the first value given for an option."""
    port = ["-p", str(host.port)] if host.port else []
    return ["ssh", *options.ssh_options, "-T", "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={math.ceil(options.connect_timeout)}",
            *port, host.destination, remote_command(options)]


def remote_command(options: SshOptions) -> str:
    python, module = shlex.quote(options.python), shlex.quote(options.worker_module)
    return (f"cd {shlex.quote(options.chdir)} || exit 1; echo {PID_MARKER}$$; "
            f"{_READ_ENVIRONMENT}; exec {python} -m {module}")


def environment_lines(names: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """``NAME=value`` lines for the forwarded variables that are set, then the empty end line."""
    environ = os.environ if environ is None else environ
    lines = []
    for name in names:
        if name not in environ:
            continue  # an unset variable stays unset on the hosts, as it is here
        value = environ[name]
        if "\n" in value or "\0" in value:
            raise ValueError(f"environment variable {name} holds a newline or NUL; it cannot be forwarded")
        lines.append(f"{name}={value}\n")
    return "".join(lines) + "\n"


def spawner_from_environment(environ: Mapping[str, str] | None = None) -> SshSpawner | None:
    """The spawner dtorch-launch asked for, or None when no hostfile was given (local workers)."""
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_HOSTFILE)
    if not path:
        return None
    options = SshOptions.from_environment(environ)
    return SshSpawner(load_hostfile(path, options), options)
