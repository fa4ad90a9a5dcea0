"""torch.distributed.checkpoint's StateDictOptions, as dtorch's checkpoint calls read them. Any object
with its fields is accepted (torch's own dataclass, also `dtorch.checkpoint.StateDictOptions`); a
field left out has torch's default. What each field does, per call (docs/design/checkpoint.md,
"StateDictOptions", has the table):

- strict: load's key check; set_*_state_dict's module load_state_dict;
- full_state_dict: load and get_*_state_dict give whole tensors: with cpu_offload torch tensors in
  this process, else Replicate DTensors. save writes the same files either way (a checkpoint holds
  global tensors), set_*_state_dict takes whole tensors as they are;
- cpu_offload: only with full_state_dict (a DTensor's shards live on the workers: alone it has
  nothing to move, and is refused by load and get);
- ignore_frozen_params: a module's frozen parameters are left out by save, load and get;
- keep_submodule_prefixes: changes nothing (no `submodules=`);
- broadcast_from_rank0: set_*_state_dict with full_state_dict, where it is what set does anyway;
  refused elsewhere (each worker reads and writes its own part);
- flatten_optimizer_state_dict, dsd_fqn_modifiers other than torch's default: refused.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Options", "resolve"]

_DEFAULTS = {"full_state_dict": False, "cpu_offload": False, "ignore_frozen_params": False,
             "keep_submodule_prefixes": True, "strict": True, "broadcast_from_rank0": False,
             "flatten_optimizer_state_dict": False, "dsd_fqn_modifiers": "_fqn_modifiers"}


class Options(NamedTuple):
    """What a dtorch call does with the options it was given."""
    strict: bool = True
    full_state_dict: bool = False         # whole tensors ...
    cpu_offload: bool = False             # ... as torch tensors in this process
    ignore_frozen_params: bool = False


def resolve(call: str, options=None, *, strict: bool | None = None) -> Options:
    """The Options of `call` ("save", "load", "get", "set") from torch's StateDictOptions (or None),
    and the call's own strict= (None: not given); ValueError for a field dtorch cannot honour,
    naming it and what to do instead."""
    given = dict(_DEFAULTS) if options is None else {name: getattr(options, name, default)
                                                     for name, default in _DEFAULTS.items()}
    where = f"dtorch.checkpoint.{call}" + ("_state_dict" if call in ("get", "set") else "")
    if given["flatten_optimizer_state_dict"]:
        raise ValueError(f"{where}: StateDictOptions(flatten_optimizer_state_dict=True) is not supported; dtorch keeps "
                         "torch's nested optimizer layout ({'state': {...}, 'param_groups': [...]}), the one "
                         "torch.distributed.checkpoint saves by default")
    if given["dsd_fqn_modifiers"] != _DEFAULTS["dsd_fqn_modifiers"]:
        raise ValueError(f"{where}: StateDictOptions(dsd_fqn_modifiers={given['dsd_fqn_modifiers']!r}) is not "
                         "supported: dtorch's modules rename no parameters, so their keys are the modules' own names")
    if given["broadcast_from_rank0"] and call != "set":
        raise ValueError(f"{where}: broadcast_from_rank0 is an option of set_state_dict (a full state dict sent "
                         "to every rank); dtorch's save and load have each worker read and write its own part")
    if given["broadcast_from_rank0"] and not given["full_state_dict"]:
        raise ValueError(f"{where}: full_state_dict must be True when broadcast_from_rank0 is True (as torch says)")
    if given["cpu_offload"] and not given["full_state_dict"] and call in ("load", "get"):
        raise ValueError(f"{where}: cpu_offload=True without full_state_dict=True has nothing to move: a DTensor's "
                         "shards live on the workers, not here. StateDictOptions(full_state_dict=True, "
                         "cpu_offload=True) gives whole torch tensors in this process")
    if strict is not None and options is not None and bool(strict) != bool(given["strict"]):
        raise ValueError(f"{where}: strict={strict} and options.strict={given['strict']} disagree; give one")
    return Options(strict=bool(given["strict"] if strict is None else strict),
                   full_state_dict=bool(given["full_state_dict"]) and call in ("load", "get"),
                   cpu_offload=bool(given["cpu_offload"]) and call in ("load", "get"),
                   ignore_frozen_params=bool(given["ignore_frozen_params"]) and call in ("save", "load", "get"))
