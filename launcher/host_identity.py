"""When two hostfile lines name one host.

A line is compared as ssh will connect: the user, host name and port that ``ssh -G`` reports
(~/.ssh/config applied: aliases, ``User``, ``Port``; by default the current user and port 22),
and the addresses that name resolves to, every loopback address counted as one ("this machine").
So ``127.0.0.1``, ``localhost``, ``root@127.0.0.1`` (run as root) and ``127.0.0.1 port=22`` are
one host, while ``alice@node1`` and ``bob@node1``, or one machine's sshd on two ports, are two.

Two lines that reach one host are an error naming both (docs/design/launcher.md: a host listed twice is
an error; write it once with ``slots=N``): its workers would count local ranks from 0 twice
(``cuda:<local rank>`` taken twice) and it would get two relays. A name that does not resolve is
an error naming its line, except for a host ssh reaches through ``ProxyJump`` or
``ProxyCommand``: the jump host resolves it, not this machine, so such a host is compared by the
name ssh would connect to.
"""
from __future__ import annotations

import getpass
import ipaddress
import os
import socket
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .hostfile import Host, HostfileError, parse_hostfile
from .options import SshOptions

__all__ = ["HostIdentity", "check_distinct_hosts", "host_identity", "load_hostfile", "ssh_settings"]

LOOPBACK = "loopback"
_SSH_CONFIG_SECONDS = 10
_RESOLVING_THREADS = 32   # ssh -G and getaddrinfo wait on other processes and DNS, not on the CPU


@dataclass(frozen=True)
class HostIdentity:
    """Where a hostfile line leads: ``places`` are its resolved addresses (LOOPBACK for any
    loopback one), or ``name:<host name>`` for a host behind a jump host."""

    user: str
    port: int
    places: frozenset[str]

    def describe(self) -> str:
        where = ("this machine (loopback)" if LOOPBACK in self.places
                 else " / ".join(sorted(place.removeprefix("name:") for place in self.places)))
        return f"{self.user}@{where} port {self.port}"


def load_hostfile(path: str | os.PathLike, options: SshOptions | None = None) -> list[Host]:
    """parse_hostfile, then check_distinct_hosts: what the runtime starts workers from."""
    hosts = parse_hostfile(path)
    check_distinct_hosts(hosts, options, os.fspath(path))
    return hosts


def check_distinct_hosts(hosts: Sequence[Host], options: SshOptions | None = None,
                         path: str = "<hostfile>") -> list[HostIdentity]:
    """Each host's identity; HostfileError naming both lines when two reach the same host, or
    naming the line of a host that does not resolve."""
    options = options if options is not None else SshOptions.from_environment()
    with ThreadPoolExecutor(max(1, min(_RESOLVING_THREADS, len(hosts)))) as pool:
        identities = list(pool.map(lambda host: host_identity(host, options, path), hosts))
    first_seen: dict[tuple, Host] = {}
    for host, identity in zip(hosts, identities):
        for place in identity.places:
            earlier = first_seen.setdefault((identity.user, identity.port, place), host)
            if earlier is not host:
                raise HostfileError(path, host.line_number, host.line, _same_host(host, earlier, identity))
    return identities


def host_identity(host: Host, options: SshOptions, path: str = "<hostfile>") -> HostIdentity:
    settings = ssh_settings(host, options)
    user = settings.get("user") or host.user or _current_user()
    port = int(settings.get("port") or host.port or 22)
    name = settings.get("hostname") or host.name
    if settings.get("proxyjump", "none") != "none" or settings.get("proxycommand", "none") != "none":
        return HostIdentity(user, port, frozenset({f"name:{name.lower()}"}))
    try:
        found = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:   # gaierror; idna refuses labels over 63 characters
        alias = f" (HostName {_shown(name)} in the ssh config)" if name != host.name else ""
        reason = f"cannot resolve host {_shown(host.name)}{alias}: {error}"
        raise HostfileError(path, host.line_number, host.line, reason) from None
    return HostIdentity(user, port, frozenset(_place(entry[4][0]) for entry in found))


def ssh_settings(host: Host, options: SshOptions) -> dict[str, str]:
    """What ``ssh -G`` would use for ``host`` (keys in lower case: user, hostname, port,
    proxyjump, ...): ~/.ssh/config and the user's ssh options applied, nothing connected.
    {} when ssh cannot tell (not installed, a timeout)."""
    port = ["-p", str(host.port)] if host.port else []
    try:
        result = subprocess.run(["ssh", *options.ssh_options, "-G", *port, host.destination],
                                capture_output=True, text=True, timeout=_SSH_CONFIG_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    settings = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        settings.setdefault(key.lower(), value)
    return settings


def _place(address: str) -> str:
    try:
        loopback = ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = False
    return LOOPBACK if loopback else address


def _shown(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else f"{text[:limit]}...")


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):   # no USER variable and no passwd entry (some containers)
        return str(os.getuid())


def _same_host(host: Host, earlier: Host, identity: HostIdentity) -> str:
    where = (f"line {earlier.line_number} ({_shown(earlier.line.strip())})" if earlier.line_number
             else earlier.destination)
    return (f"{host.destination} is the same host as {where}: both reach {identity.describe()}; "
            f"list it once, with slots=N for all its workers")
