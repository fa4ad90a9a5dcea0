"""Which address of this machine the workers should connect back to.

The controller listens on one address, and every worker must be able to reach it. By default that
is the address this machine uses to send to the first host of the hostfile: the kernel's routing
table already knows which interface faces the cluster. ``--controller-address`` overrides it
(multi-homed machines, NAT, hosts reached only through a jump host).
"""
from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence

from .hostfile import Host, parse_hostfile
from .options import SshOptions

__all__ = ["address_toward", "controller_host", "resolve_host"]

_SSH_CONFIG_SECONDS = 10
_DISCARD_PORT = 9  # any port: connecting a UDP socket sends nothing, it only picks the route


def controller_host(hostfile: str | os.PathLike | Sequence[Host], options: SshOptions | None = None) -> str:
    """This machine's address on the route to the first host (127.0.0.1 when the hosts are local)."""
    hosts = parse_hostfile(hostfile) if isinstance(hostfile, (str, os.PathLike)) else list(hostfile)
    options = options if options is not None else SshOptions.from_environment()
    return address_toward(resolve_host(hosts[0], options))


def address_toward(address: str) -> str:
    """This machine's address on the route to ``address`` (the kernel's routing table decides)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, _DISCARD_PORT))
        return probe.getsockname()[0]


def resolve_host(host: Host, options: SshOptions) -> str:
    """The IP address ssh will connect to for ``host``, after ~/.ssh/config aliases (HostName)."""
    name = _ssh_host_name(host, options)
    try:
        return socket.getaddrinfo(name, host.port or 22, type=socket.SOCK_DGRAM)[0][4][0]
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {host.name} ({name}) to choose the address workers connect "
                         f"back to: {error}; pass --controller-address") from None


def _ssh_host_name(host: Host, options: SshOptions) -> str:
    # `ssh -G` prints the configuration ssh would use without connecting, aliases resolved.
    try:
        result = subprocess.run(["ssh", *options.ssh_options, "-G", host.destination],
                                capture_output=True, text=True, timeout=_SSH_CONFIG_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return host.name
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    return host.name
