"""Which address of this machine the workers should connect back to.

The controller listens on one address, and every worker must be able to reach it. By default that
is the address this machine uses to send to the first host of the hostfile: the kernel's routing
table already knows which interface faces the cluster. ``--controller-address`` overrides it
(multi-homed machines, NAT, hosts reached only through a jump host).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence

from .host_identity import ssh_settings
from .hostfile import Host, parse_hostfile
from .options import SshOptions

__all__ = ["address_toward", "controller_host", "resolve_host"]

_DISCARD_PORT = 9  # any port: connecting a UDP socket sends nothing, it only picks the route


def controller_host(hostfile: str | os.PathLike | Sequence[Host], options: SshOptions | None = None) -> str:
    """This machine's address on the route to the first host (127.0.0.1 when the hosts are local,
    also for a name that resolves to ::1, which the controller's ZeroMQ sockets do not bind)."""
    hosts = parse_hostfile(hostfile) if isinstance(hostfile, (str, os.PathLike)) else list(hostfile)
    options = options if options is not None else SshOptions.from_environment()
    address = address_toward(resolve_host(hosts[0], options))
    return "127.0.0.1" if ipaddress.ip_address(address.split("%", 1)[0]).is_loopback else address


def address_toward(address: str) -> str:
    """This machine's address on the route to ``address`` (the kernel's routing table decides)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, _DISCARD_PORT))
        return probe.getsockname()[0]


def resolve_host(host: Host, options: SshOptions) -> str:
    """The IP address ssh will connect to for ``host``, after ~/.ssh/config aliases (HostName)."""
    name = ssh_settings(host, options).get("hostname") or host.name
    try:
        return socket.getaddrinfo(name, host.port or 22, type=socket.SOCK_DGRAM)[0][4][0]
    except (OSError, UnicodeError) as error:
        raise ValueError(f"cannot resolve {host.name[:80]} ({name[:80]}) to choose the address workers connect "
                         f"back to: {error}; pass --controller-address") from None
