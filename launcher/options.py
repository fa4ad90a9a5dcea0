"""SshOptions: how workers are started on the hosts, and how those settings reach the runtime.

dtorch-launch does not start workers itself: it puts the options into the environment and runs
the user's script, and the runtime builds an SshSpawner from them when the script creates its
first mesh. The environment is the hand-over because it is the one channel that survives
``runpy`` and reaches code the launcher never calls directly.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

__all__ = [
    "DEFAULT_WORKER_MODULE", "ENV_CONTROLLER_ADDRESS", "ENV_HOSTFILE", "ENV_OPTIONS", "OptionsError",
    "SshOptions",
]

ENV_HOSTFILE = "DTORCH_HOSTFILE"
ENV_OPTIONS = "DTORCH_LAUNCH_OPTIONS"
ENV_CONTROLLER_ADDRESS = "DTORCH_CONTROLLER_ADDRESS"
DEFAULT_WORKER_MODULE = "dtorch.runtime.processes.worker_process"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class OptionsError(ValueError):
    """A launcher option that cannot work; the message names it and what was given."""


# The JSON in DTORCH_LAUNCH_OPTIONS (or a caller) may hold anything: each field's accepted types.
_FIELD_TYPES = {"python": (str,), "chdir": (str,), "env": (list, tuple), "ssh_options": (list, tuple),
                "log_dir": (str, type(None)), "connect_timeout": (int, float), "worker_module": (str,)}


@dataclass
class SshOptions:
    """Settings for starting workers over ssh; every field has a working default.

    python, chdir: paths ON THE HOSTS; the defaults assume the hosts mirror the controller
        (same interpreter path, same directory, e.g. a shared filesystem or identical images).
    env: names of the controller's environment variables to give every worker. Their values
        travel over the ssh channel's stdin, never on a command line, so secrets are safe.
    ssh_options: raw arguments passed to ssh before everything else, e.g. ["-F", "ssh_config"];
        an ``-o`` given here wins over the launcher's own ``-o`` settings.
    log_dir: if set, each worker's output is also written to <log_dir>/rank<N>.log (appended).
    connect_timeout: seconds ssh may take to connect (ssh rounds it up to whole seconds).
    worker_module: the module run with ``python -m``; tests and custom workers change it.
    """

    python: str = field(default_factory=lambda: sys.executable)
    chdir: str = field(default_factory=os.getcwd)
    env: list[str] = field(default_factory=list)
    ssh_options: list[str] = field(default_factory=list)
    log_dir: str | None = None
    connect_timeout: float = 10.0
    worker_module: str = DEFAULT_WORKER_MODULE

    def __post_init__(self):
        _check_types(self)
        self.env, self.ssh_options = list(self.env), list(self.ssh_options)
        bad_names = [name for name in self.env if not _ENV_NAME.match(name)]
        if bad_names:
            raise OptionsError(f"not environment variable names: {bad_names} (give names, not NAME=value)")
        if not (self.connect_timeout > 0 and math.isfinite(self.connect_timeout)):
            raise OptionsError(f"connect_timeout must be a positive number of seconds, got {self.connect_timeout}")
        if not _MODULE_NAME.match(self.worker_module):
            raise OptionsError(f"worker_module must be a dotted module name, got {self.worker_module!r}")
        if not self.python or not self.chdir:
            raise OptionsError("python and chdir must not be empty")

    def to_environment(self) -> dict[str, str]:
        """The variables that carry these options to the runtime; merge them into os.environ."""
        return {ENV_OPTIONS: json.dumps(asdict(self))}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SshOptions:
        """The options dtorch-launch stored, or the defaults when it stored none."""
        environ = os.environ if environ is None else environ
        text = environ.get(ENV_OPTIONS)
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise OptionsError(f"{ENV_OPTIONS} is not valid JSON: {error}") from None
        return cls(**_known_fields(cls, values))


def _known_fields(cls, values) -> dict:
    if not isinstance(values, dict):
        raise OptionsError(f"{ENV_OPTIONS} must hold a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise OptionsError(f"{ENV_OPTIONS} has unknown options {unknown}: launcher and runtime versions differ?")
    return values


def _check_types(options: SshOptions) -> None:
    for name, accepted in _FIELD_TYPES.items():
        value = getattr(options, name)
        if not isinstance(value, accepted) or isinstance(value, bool):
            raise OptionsError(f"option {name} must be {' or '.join(t.__name__ for t in accepted)}, "
                               f"got {type(value).__name__}: {value!r:.80}")
    for name in ("env", "ssh_options"):
        strings = getattr(options, name)
        if not all(isinstance(item, str) for item in strings):
            raise OptionsError(f"option {name} must be a list of strings, got {strings!r:.80}")
    if any("\0" in text for text in [options.python, options.chdir, *options.ssh_options]):
        raise OptionsError("options must not contain NUL characters")
