"""dtorch-launch: start dtorch workers on the hosts of a hostfile over OpenSSH, or with srun inside
a SLURM allocation (--slurm).

Installed as ``dtorch_launcher`` (a top-level ``launcher`` would collide in site-packages).
The runtime uses ``spawner_from_environment()`` to get the SshSpawner that dtorch-launch asked
for, and StartupProgress / explain_ssh_failure to report workers coming up. See docs/design/launcher.md.

Modules: cli (the dtorch-launch command), hostfile (parsing), host_identity (which lines name
one host, after ssh's config and name resolution), options (ssh options from the
environment), addresses (which address workers reach the controller on), ssh (SshSpawner: one ssh
session per worker), relays (one relay per host with several slots: the commands cross the
network once per host), slurm (SlurmSpawner: one srun step per worker in a SLURM job), progress
and output (what a start prints), failures (why a start failed).
"""
from .addresses import controller_host
from .failures import explain_ssh_failure
from .host_identity import check_distinct_hosts, load_hostfile
from .hostfile import Host, HostfileError, parse_hostfile
from .options import ENV_CONTROLLER_ADDRESS, ENV_HOSTFILE, ENV_OPTIONS, OptionsError, SshOptions
from .progress import StartupProgress
from .ssh import SshSpawner, SshWorker, spawner_from_environment
from .slurm import ENV_SLURM, Allocation, SlurmError, SlurmSpawner, SlurmWorker, slurm_spawner_from_environment

__all__ = [
    "ENV_CONTROLLER_ADDRESS", "ENV_HOSTFILE", "ENV_OPTIONS", "Host", "HostfileError", "OptionsError", "SshOptions",
    "SshSpawner", "SshWorker", "StartupProgress", "controller_host", "explain_ssh_failure", "parse_hostfile",
    "spawner_from_environment", "check_distinct_hosts", "load_hostfile",
    "ENV_SLURM", "Allocation", "SlurmError", "SlurmSpawner", "SlurmWorker", "slurm_spawner_from_environment",
]
