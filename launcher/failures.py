"""Turn what a failed ``ssh host 'cd DIR && exec PYTHON -m MODULE'`` printed into one clear sentence.

ssh exits with 255 for its own failures (cannot connect, cannot log in) and otherwise passes the
remote command's exit code through, so the exit code plus the last stderr lines say which step
failed. The rules are data: one row per known cause, checked in order, first match wins.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from .options import DEFAULT_WORKER_MODULE

__all__ = ["explain_ssh_failure"]

SSH_FAILED = 255     # ssh's own exit code for connection and authentication failures
NOT_FOUND = 127      # POSIX shells' exit code for "command not found"
WORKER_CANNOT_START = 2   # dtorch.runtime.processes.worker_process._fail_start


class _Cause(NamedTuple):
    pattern: str          # regular expression searched in stderr
    exit_code: int | None  # None: any exit code
    message: str          # formatted with host, python, module, detail


_CAUSES = (
    # The worker ran and said why it cannot start (no GPU for its slot, no cupy, ...); its
    # traceback may hold any text below, e.g. "No module named 'cupy'", so this row comes first.
    _Cause(r"dtorch worker \d+ cannot start: ", WORKER_CANNOT_START, "on {host}: {detail}"),
    _Cause(r"Could not resolve hostname", SSH_FAILED,
           "cannot resolve host name {host!r}: check the hostfile and ~/.ssh/config"),
    _Cause(r"Connection refused", SSH_FAILED,
           "connection to {host} refused: is sshd running there, and is the port right?"),
    _Cause(r"No route to host|Network is unreachable", SSH_FAILED,
           "no network route to {host}: is the machine up and the address right?"),
    _Cause(r"timed out", SSH_FAILED,
           "connecting to {host} timed out: the machine is down, unreachable or firewalled "
           "(raise --connect-timeout if it is only slow)"),
    _Cause(r"Permission denied", SSH_FAILED,
           "ssh login to {host} was refused: ssh runs with BatchMode=yes, so it needs a key or an "
           "agent that logs in without a password prompt"),
    _Cause(r"Host key verification failed", SSH_FAILED,
           "host key of {host} is unknown or changed: connect once by hand with ssh, or fix "
           "known_hosts"),
    _Cause(r"\bcd:|:cd:", None,
           "cannot enter the working directory on {host}: {detail} (set --chdir to a directory "
           "that exists there)"),
    _Cause(r"No module named", None,
           "{python} on {host} cannot import {module}: {detail} (install dtorch for that "
           "interpreter, or point --python at one that has it)"),
    _Cause(r"not found|No such file or directory", NOT_FOUND,
           "python {python!r} not found on {host}: {detail} (set --python to an interpreter that "
           "exists there)"),
    _Cause(r"Connection closed|Connection reset|Broken pipe|closed by remote host", SSH_FAILED,
           "ssh connection to {host} was lost: {detail}"),
)


def explain_ssh_failure(host: str, exit_code: int | None, stderr: str,
                        python: str = "python", module: str = DEFAULT_WORKER_MODULE) -> str:
    """One sentence naming ``host`` and the likely cause of a failed worker start or a lost worker."""
    detail = _last_meaningful_line(stderr)
    for cause in _CAUSES:
        if cause.exit_code not in (None, exit_code):
            continue
        if re.search(cause.pattern, stderr):
            return cause.message.format(host=host, python=python, module=module, detail=detail)
    return _generic_message(host, exit_code, detail)


def _generic_message(host: str, exit_code: int | None, detail: str) -> str:
    if exit_code is not None and exit_code < 0:
        status = f"was killed by signal {-exit_code}"
    else:
        status = f"exited with code {exit_code}"
    message = f"worker on {host} {status}"
    return f"{message}: {detail}" if detail else message


def _last_meaningful_line(stderr: str) -> str:
    # Tracebacks end with the exception line, shell errors are one line: the last is the one to show.
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""
