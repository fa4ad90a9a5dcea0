"""The Gloo rendezvous store the controller hosts (a torch TCPStore), bound to one address.

torch's TCPStore server listens on every interface ("*") whatever host name it is given; a local
session would then expose its store to the whole network. We bind the listening socket ourselves
and hand torch the descriptor, so the store is reachable only where the controller listens
(127.0.0.1 for local sessions). The store is plain TCP: see docs/design/launcher.md's security model.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from ...errors import StartupError

__all__ = ["host_store"]


def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """A master TCPStore listening on `host` only, and the "host:port" workers connect to."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        try:
            listener.bind((host, 0))
        except OSError as error:   # an address not of this machine (controller_address, a hostfile's)
            raise StartupError(f"the controller cannot listen on {host!r}: {error.strerror}; controller_address "
                               "(or DTORCH_CONTROLLER_ADDRESS) must be an address of this machine that workers "
                               "reach") from None
        listener.listen(1024)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()   # the store's server owns the descriptor now and closes it
    return store, f"{host}:{port}"
