"""The hostfile: which machines take part in a run, and how many workers each one runs.

One host per line, the DeepSpeed / MPI convention:

    # comment
    node1 slots=4
    alice@node2 slots=4 port=2222

A host is any destination OpenSSH accepts (an alias from ~/.ssh/config, a name, an address),
optionally prefixed with ``user@``. ``slots`` (default 1) is the number of workers it runs.
``port`` is a convenience for setups without an ssh config; ~/.ssh/config is the usual place
for ports, users, keys and jump hosts, and everything in it applies as usual.

Parsing is text only: a line written twice is refused here, and host_identity.py then refuses
two lines that reach one host once ssh's config and name resolution are applied.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = ["Host", "HostfileError", "parse_hostfile", "parse_hostfile_text"]

# Letters, digits and the punctuation of host names, IPv4 and bracket-less IPv6 addresses.
# Anything else (a leading "-", spaces, shell metacharacters) would reach ssh's argv.
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.:%][A-Za-z0-9_.:%-]*$")
_USER_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")
_KNOWN_KEYS = ("slots", "port")
# A DNS name has at most 253 characters; ssh config aliases get room up to NI_MAXHOST (1025).
# Without a bound a 100,000-character name reached ssh and the resolver.
_MAX_HOST_NAME = 1024
_SHOWN_LINE = 200   # characters of a bad line an error quotes


class HostfileError(ValueError):
    """A hostfile line that cannot be used; the message names the file and the line number."""

    def __init__(self, path: str, line_number: int, line: str, reason: str):
        self.path, self.line_number, self.line, self.reason = path, line_number, line, reason
        shown = line.strip()
        shown = shown if len(shown) <= _SHOWN_LINE else f"{shown[:_SHOWN_LINE]}... ({len(shown)} characters)"
        super().__init__(f"{path}:{line_number}: {reason}: {shown!r}")


@dataclass(frozen=True)
class Host:
    """One machine of the run: ``name`` is what ssh connects to, ``slots`` how many workers it runs.
    ``line_number`` and ``line``: where the hostfile listed it (errors quote them); 0 and "" for
    a Host made in code."""

    name: str
    slots: int = 1
    user: str | None = None
    port: int | None = None
    line_number: int = field(default=0, compare=False, repr=False)
    line: str = field(default="", compare=False, repr=False)

    @property
    def destination(self) -> str:
        """The ``[user@]name`` argument for ssh."""
        return f"{self.user}@{self.name}" if self.user else self.name


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read a hostfile. Raises HostfileError (a ValueError) naming the file and line of a bad line."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as file:
        return parse_hostfile_text(file.read(), path)


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> list[Host]:
    hosts: list[Host] = []
    first_line_of: dict[tuple, int] = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        host = _parse_line(content, path, line_number, line)
        key = (host.destination, host.port)
        if key in first_line_of:
            reason = f"host {host.destination} is already listed on line {first_line_of[key]}"
            raise HostfileError(path, line_number, line, reason)
        first_line_of[key] = line_number
        hosts.append(host)
    if not hosts:
        raise HostfileError(path, 0, "", "no hosts in hostfile")
    return hosts


def _parse_line(content: str, path: str, line_number: int, line: str) -> Host:
    def fail(reason: str) -> HostfileError:
        return HostfileError(path, line_number, line, reason)

    destination, *settings = content.split()
    user, name = _split_destination(destination, fail)
    values = _parse_settings(settings, fail)
    return Host(name=name, user=user, slots=values.get("slots", 1), port=values.get("port"),
                line_number=line_number, line=line)


def _split_destination(destination: str, fail) -> tuple[str | None, str]:
    user, _, name = destination.rpartition("@")
    if user and not _USER_NAME.match(user):
        raise fail(f"bad user name {user[:80]!r}")
    if destination.startswith("@") or not _HOST_NAME.match(name):
        raise fail(f"bad host name {name[:80]!r} (expected [user@]host, e.g. node1 or alice@10.0.0.2)")
    if len(name) > _MAX_HOST_NAME:
        raise fail(f"host name of {len(name)} characters (at most {_MAX_HOST_NAME} can be resolved)")
    return user or None, name


def _parse_settings(settings: list[str], fail) -> dict[str, int]:
    values: dict[str, int] = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or key not in _KNOWN_KEYS:
            raise fail(f"unknown setting {setting!r} (expected slots=N or port=N)")
        if key in values:
            raise fail(f"{key} given twice")
        # ASCII digits only ("²".isdigit() is true), and short: int() refuses 4300+ digits
        if not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 1:
            raise fail(f"{key} must be a positive integer, got {value!r}")
        values[key] = int(value)
    if values.get("port", 1) > 65535:
        raise fail(f"port {values['port']} is out of range")
    return values
