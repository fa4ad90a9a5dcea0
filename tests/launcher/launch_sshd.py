"""Real OpenSSH servers for the launcher tests: keys, sshd_config, ssh_config, start and stop.

Each server is Debian's /usr/sbin/sshd in the foreground (-D), logging to a file (-e), with a
generated config that lets the current user in with a per-run key and nothing else.
"""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
START_SECONDS = 10.0


def missing_tools() -> str | None:
    """Why real-sshd tests cannot run here, or None when they can."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (install openssh-server: .ci/setup_sshd.sh)"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not found (install openssh-client: .ci/setup_sshd.sh)"
    return None


@dataclass
class KeyMaterial:
    directory: Path
    client_key: Path
    host_key: Path
    authorized_keys: Path


def generate_keys(directory: Path) -> KeyMaterial:
    client_key, host_key = directory / "client_ed25519", directory / "host_ed25519"
    for key in (client_key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dtorch-test",
                        "-f", str(key)], check=True, timeout=30)
    authorized_keys = directory / "authorized_keys"
    shutil.copy(f"{client_key}.pub", authorized_keys)
    return KeyMaterial(directory, client_key, host_key, authorized_keys)


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


class SshServer:
    """One sshd listening on ``address:port``; ``command_prefix`` runs it elsewhere (ip netns exec)."""

    def __init__(self, keys: KeyMaterial, name: str, address: str, port: int,
                 command_prefix: tuple[str, ...] = ()):
        self.name, self.address, self.port = name, address, port
        self.config = keys.directory / f"sshd_config.{name}"
        self.log = keys.directory / f"sshd.{name}.log"
        self.config.write_text(_sshd_config(keys, address, port))
        self._command = [*command_prefix, SSHD, "-D", "-e", "-f", str(self.config)]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # root's sshd refuses to start without it
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self._command, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log, start_new_session=True)

    def wait_ready(self, connect) -> None:
        """Poll until sshd accepts a connection; ``connect`` tries one (it may run in a netns)."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd {self.name} exited with {self.process.returncode}: {self.log_text()}")
            if connect(self.address, self.port):
                return
            time.sleep(0.05)
        raise TimeoutError(f"sshd {self.name} not listening on {self.address}:{self.port}: {self.log_text()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"


def can_connect(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def write_ssh_config(keys: KeyMaterial, servers: list[SshServer], name: str) -> Path:
    """An ``ssh -F`` file: one alias per server, and the per-run key with host-key checks off."""
    path = keys.directory / f"ssh_config.{name}"
    aliases = [f"Host {s.name}\n  HostName {s.address}\n  Port {s.port}\n" for s in servers]
    path.write_text("".join(aliases) + _CLIENT_DEFAULTS.format(user=getpass.getuser(), key=keys.client_key))
    os.chmod(path, 0o600)  # ssh refuses a config file that others may write
    return path


_CLIENT_DEFAULTS = """Host *
  User {user}
  IdentityFile {key}
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  LogLevel ERROR
"""


def _sshd_config(keys: KeyMaterial, address: str, port: int) -> str:
    # StrictModes no: the tmp directory's permissions are whatever the test runner's umask made them.
    # UsePAM no: PAM would want a full login setup; key authentication alone is what is tested.
    return f"""ListenAddress {address}
Port {port}
HostKey {keys.host_key}
AuthorizedKeysFile {keys.authorized_keys}
PidFile none
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
PrintMotd no
LogLevel ERROR
MaxStartups 100:30:200
MaxSessions 100
"""
