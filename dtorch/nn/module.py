"""dtorch.nn.Module: torch.nn.Module's machinery over DTensor parameters.

It IS a torch.nn.Module (named_parameters, state_dict, hooks, train/eval, apply, repr and the
containers all come from torch), with the few places where torch assumes local tensors replaced:
registration accepts only dtorch Parameters and DTensor buffers, `load_state_dict` checks every
key and shape before it sends anything and then uploads one tensor at a time (each worker
receives only its own slice), and `to` / `float` / ... rebind parameters to new symbols.

Each module may also move its input and output, as DTorch's modules do: `__call__` runs
`redistribute_input(*args, **kwargs) -> (args, kwargs)`, then torch's hooks and `forward`, then
`redistribute_output(output) -> output`. Both are identities unless a layer overrides them.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch

from ..dtensor import compile_capture as capturing
from ..spec.placements import DeviceMesh
from ..errors import UnsupportedOpError, user_site
from ..dtensor.factories import tensor as upload
from ..ops.conversions import device_refusal
from ..ops.tensor_meta import is_local_tensor
from ..dtensor.recording import no_grad
from ..dtensor.tensor import DTensor
from ..runtime.controller import session
from .parameter import Parameter
from .progress import ProgressBar

__all__ = ["Module", "IncompatibleKeys", "set_path_loader", "loadable_tensors", "tie_groups", "check_loadable",
           "to_target", "put_tensor", "castable", "describe_incompatible", "SYNC_BYTES"]


class IncompatibleKeys(NamedTuple):
    """What load_state_dict returns (torch's `_IncompatibleKeys` fields)."""
    missing_keys: list
    unexpected_keys: list


# Uploads wait for the workers after about this many bytes: a queued upload holds its bytes on
# the controller until the loop thread sends it, so a large state_dict would otherwise sit here
# twice. (dtorch.checkpoint's via_controller path uses the same bound.)
SYNC_BYTES = 256 << 20

# dtorch.checkpoint installs the loader for file paths (a layer above nn: nn never imports it)
_path_loader: Callable | None = None


def set_path_loader(loader: Callable) -> None:
    """Called by dtorch.checkpoint: `loader(module, path, strict, progress, via_controller) -> IncompatibleKeys`."""
    global _path_loader
    _path_loader = loader


def _no_backward_hooks(method: str) -> UnsupportedOpError:
    # torch runs these around its own autograd on torch.Tensor outputs; a DTensor's backward runs
    # on the workers, so torch would only warn and never call the hook
    return UnsupportedOpError(f"module.{method} at {user_site()}: module backward hooks are not supported on dtorch "
                              "modules (their gradients are computed on the workers). Read the parameters' .grad "
                              "after backward(), or use dtorch.autograd.grad(loss, [tensor]) for an activation's")


class Module(torch.nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)

    # --- DTorch's hooks around forward -------------------------------------------------------
    def redistribute_input(self, *args, **kwargs):
        """Move inputs before forward; returns (args, kwargs). Identity unless overridden."""
        return args, kwargs

    def redistribute_output(self, output):
        """Move the output after forward. Identity unless overridden."""
        return output

    def __call__(self, *args, **kwargs):
        capture = capturing.active()
        if capture is not None:   # dtorch.compile: guard this module's settings
            capture.note_module(self)
        args, kwargs = self.redistribute_input(*args, **kwargs)
        return self.redistribute_output(torch.nn.Module.__call__(self, *args, **kwargs))

    # --- torch's backward hooks: refused, not silently never called ------------------------------
    def register_full_backward_hook(self, hook, prepend: bool = False):
        raise _no_backward_hooks("register_full_backward_hook")

    def register_full_backward_pre_hook(self, hook, prepend: bool = False):
        raise _no_backward_hooks("register_full_backward_pre_hook")

    def register_backward_hook(self, hook):
        raise _no_backward_hooks("register_backward_hook")

    # --- registration: dtorch tensors only -----------------------------------------------------
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameters before Module.__init__() call")
        _check_member_name(self, name, "_parameters")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(_wrong_tensor_kind(name, param, "parameter", "dtorch.nn.Parameter or None"))
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: DTensor | None, persistent: bool = True) -> None:
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffers before Module.__init__() call")
        _check_member_name(self, name, "_buffers")
        if tensor is not None and not isinstance(tensor, DTensor):
            raise TypeError(_wrong_tensor_kind(name, tensor, "buffer", "a DTensor or None"))
        self._buffers[name] = tensor
        (self._non_persistent_buffers_set.discard if persistent else self._non_persistent_buffers_set.add)(name)

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        _refuse_local_weights(name, module)
        super().add_module(name, module)

    register_module = add_module

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            for members in (self.__dict__, self._buffers, self._modules):
                members.pop(name, None)
            self._non_persistent_buffers_set.discard(name)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(_wrong_tensor_kind(name, value, "parameter", "dtorch.nn.Parameter or None"))
            params[name] = None
        elif isinstance(value, torch.nn.Parameter):  # a plain torch tensor is a controller-side value
            raise TypeError(_wrong_tensor_kind(name, value, "attribute", "a DTensor (dtorch.nn.Parameter for a "
                                               "parameter)"))
        elif isinstance(value, DTensor) and name in self.__dict__.get("_buffers", ()):
            self._buffers[name] = value
        else:
            if isinstance(value, torch.nn.Module):
                _refuse_local_weights(name, value)
            super().__setattr__(name, value)

    # --- where the module lives ------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh of the first parameter (or buffer); None for a module without tensors."""
        for tensor in self._all_tensors():
            return tensor.device_mesh
        return None

    def _all_tensors(self) -> Iterator[DTensor]:
        yield from self.parameters()
        yield from self.buffers()

    # --- conversions: every one rebinds the tensors to new symbols ------------------------------
    def _apply(self, fn, recurse: bool = True):
        if recurse:
            for module in self.children():
                module._apply(fn)
        for name, param in self._parameters.items():
            if param is not None:
                applied = fn(param)
                if applied is not param:
                    self._parameters[name] = Parameter(applied, param.requires_grad)
        for name, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[name] = fn(buffer)
        return self

    def no_sync(self):
        """DDP's spelling of dtorch.autograd.no_sync(): backward calls inside it accumulate the
        data-parallel gradients unreduced (gradient accumulation); the step reduces them once."""
        from ..autograd import no_sync   # nn sits beside autograd; the import is deferred to the call
        return no_sync()

    def to(self, *args, **kwargs):
        """module.to(dtype) casts floating-point tensors; module.to(device_mesh) (or
        to(device_mesh=...)) moves every tensor to another mesh of the same number of dims,
        keeping its placements. module.to(device) with its mesh's own device ("cpu" on a CPU
        mesh, as transformers' and diffusers' code calls it) changes nothing; another device
        type is refused with what to write (a mesh says which workers hold the tensors)."""
        dtype, mesh, device = kwargs.pop("dtype", None), kwargs.pop("device_mesh", None), kwargs.pop("device", None)
        kwargs.pop("non_blocking", None)
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, DeviceMesh):
                mesh = arg
            elif isinstance(arg, (str, torch.device)):
                device = arg
            else:
                raise TypeError(f"Module.to({arg!r}): dtorch modules take a dtype, a device or a DeviceMesh")
        if kwargs:
            raise TypeError(f"Module.to: unexpected arguments {sorted(kwargs)}")
        if device is not None:
            self._check_device(torch.device(device), f"module.to({str(device)!r})")
        if mesh is not None:
            self._apply(lambda t: t.redistribute(mesh, t.placements) if t.device_mesh != mesh else t)
        if dtype is not None:
            self._apply(lambda t: t.to(dtype) if t.dtype.is_floating_point else t)
        return self

    def float(self):
        return self.to(torch.float32)

    def double(self):
        return self.to(torch.float64)

    def half(self):
        return self.to(torch.float16)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def cuda(self, device=None):
        """Nothing to do on a CUDA mesh; a CPU mesh refuses (build on init_device_mesh('cuda', ...),
        or move with module.to(cuda_mesh))."""
        self._check_device(torch.device("cuda"), "module.cuda()")
        return self

    def cpu(self):
        """Nothing to do on a CPU mesh; a CUDA mesh refuses (read a tensor with to_torch(), or move
        the module with module.to(cpu_mesh))."""
        self._check_device(torch.device("cpu"), "module.cpu()")
        return self

    def _check_device(self, device: torch.device, call: str) -> None:
        for tensor in loadable_tensors(self).values():
            if tensor.device_mesh.device_type != device.type:
                raise device_refusal(call, device, tensor.device_mesh)

    # --- loading ------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False, *,
                        progress: bool | None = None, via_controller: bool = False) -> IncompatibleKeys:
        """Load torch tensors, DTensors, or a checkpoint path (a .safetensors file or a
        transformers directory; each worker then reads its own slices from the file).

        Every key, shape and dtype is checked before anything is sent, so a bad state_dict
        leaves the module as it was. torch tensors are uploaded one at a time with the target
        parameter's placements: each worker receives only its own slice. DTensors are cast and
        redistributed to the target's mesh and placements. As torch's `param.copy_(value)`, the
        values are copied into the target's own tensors: each Parameter keeps its identity (an
        optimizer made before still holds it), and the state_dict given stays usable and
        independent (an EMA or reference copy loaded from a model never shares its buffers).
        `assign` is accepted for torch's signature and changes nothing. via_controller
        (a path only): read the file here and upload, for hosts that do not all see the path."""
        if isinstance(state_dict, (str, os.PathLike)):
            if _path_loader is None:
                raise RuntimeError("loading from a path needs dtorch.checkpoint: `import dtorch` first")
            return _path_loader(self, state_dict, strict, progress, via_controller)
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict expects a mapping or a path, got {type(state_dict).__name__}")
        targets = loadable_tensors(self)
        tied = tie_groups(targets)
        present = {id(targets[k]) for k in state_dict if k in targets}
        keys = IncompatibleKeys([k for k in targets if id(targets[k]) not in present],
                                [k for k in state_dict if k not in targets])
        if strict and (keys.missing_keys or keys.unexpected_keys):
            raise RuntimeError(describe_incompatible(type(self).__name__, keys))
        # one load per tensor: the first of its names that the state_dict has
        names = list({id(targets[k]): k for k in reversed(targets) if k in state_dict}.values())[::-1]
        check_loadable({k: state_dict[k] for k in names}, {k: targets[k] for k in names})
        sizes = [targets[k].numel() * targets[k].dtype.itemsize for k in names]
        bar = ProgressBar(len(names), sum(sizes), progress)
        controller, waiting = session.controller(), 0
        try:
            for name, size in zip(names, sizes):
                put_tensor(self, tied[id(targets[name])], to_target(state_dict[name], targets[name]))
                waiting += size
                if waiting >= SYNC_BYTES:   # queued uploads hold their bytes until they are sent
                    controller.synchronize()
                    bar.advance(0, waiting)
                    waiting = 0
                bar.advance(1, 0)
        finally:
            bar.close()
        return keys


# --- what load_state_dict works with (dtorch.checkpoint reuses these) -----------------------------
def loadable_tensors(module: torch.nn.Module) -> OrderedDict[str, DTensor]:
    """state_dict's keys, each with the tensor it names now (parameters and persistent buffers)."""
    found = OrderedDict()
    for prefix, owner in module.named_modules():
        dot = prefix + "." if prefix else ""
        for name, param in owner._parameters.items():
            if param is not None:
                found.setdefault(dot + name, param)
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found.setdefault(dot + name, buffer)
    return found


def tie_groups(targets: Mapping[str, DTensor]) -> dict[int, list[str]]:
    """Names that share one tensor (tied weights: lm_head.weight is embed_tokens.weight): loading
    any of them loads all, and a checkpoint that stores only one (save_pretrained) is complete."""
    groups: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        groups.setdefault(id(tensor), []).append(name)
    return groups


def describe_incompatible(owner: str, keys: IncompatibleKeys) -> str:
    parts = []
    for label, names in (("Missing key(s)", keys.missing_keys), ("Unexpected key(s)", keys.unexpected_keys)):
        if names:
            shown = ", ".join(repr(n) for n in names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            parts.append(f"{label} in state_dict: {shown}")
    return (f"Error(s) in loading state_dict for {owner}: " + ". ".join(parts) +
            ". Nothing was loaded; pass strict=False to load the keys that match.")


def check_loadable(values: Mapping, targets: Mapping[str, DTensor]) -> None:
    """Every value must have its target's shape and a dtype that casts to it; one error lists all."""
    problems = []
    for name, value in values.items():
        target = targets[name]
        if not isinstance(value, (torch.Tensor, DTensor)):
            problems.append(f"{name!r}: expected a tensor, got {type(value).__name__}")
        elif tuple(value.shape) != tuple(target.shape):
            problems.append(f"{name!r}: the checkpoint has shape {tuple(value.shape)}, the model "
                            f"{tuple(target.shape)}")
        elif not castable(value.dtype, target.dtype):
            problems.append(f"{name!r}: cannot cast {value.dtype} to the model's {target.dtype}")
    if problems:
        raise RuntimeError("Error(s) in loading state_dict: " + "; ".join(problems) +
                           ". Nothing was loaded.")


def castable(source: torch.dtype, target: torch.dtype) -> bool:
    """torch.can_cast (numpy's "same_kind"): float -> any float, int -> int or float, bool -> any.
    Never float -> int or anything -> bool: that would silently truncate weights."""
    return torch.can_cast(source, target)


def to_target(value, target: DTensor) -> DTensor:
    """`value` with the target's dtype, mesh and placements."""
    if isinstance(value, DTensor):
        with no_grad():
            if value.dtype != target.dtype:   # a cast makes new buffers on the workers
                return value.to(target.dtype).redistribute(target.device_mesh, target.placements)
            # else a copy: the target must never take the caller's tensor, nor a redistribute's
            # view of its buffers (R -> S(d) slices them locally), or an in-place step on one model
            # would change the other (EMA, teacher and reference copies)
            return value.redistribute(target.device_mesh, target.placements).clone()
    return upload(value.detach().to(target.dtype), device_mesh=target.device_mesh, placements=target.placements)


def put_tensor(module: torch.nn.Module, names: list[str], value: DTensor) -> None:
    """Give the parameter or buffer at each dotted name (one tensor, tied names share it) the
    values of `value`. A Parameter keeps its identity, as torch's in-place copy keeps it: an
    optimizer made before the load still holds the model's parameters (and their gradients)."""
    updated = set()
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if attr in owner._parameters:
            param = owner._parameters[attr]
            if isinstance(param, Parameter):
                if id(param) not in updated:
                    with no_grad():
                        param._assign(value, "load_state_dict")
                    updated.add(id(param))
            else:
                owner._parameters[attr] = Parameter(value)
        else:
            owner._buffers[attr] = value


# --- registration checks -------------------------------------------------------------------------
def _check_member_name(module: torch.nn.Module, name: str, kind: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name should be a string, got {type(name).__name__}")
    if "." in name or name == "":
        raise KeyError(f"name {name!r} must be non-empty and contain no '.'")
    if hasattr(module, name) and name not in getattr(module, kind):
        raise KeyError(f"attribute {name!r} already exists")


def _wrong_tensor_kind(name: str, value, kind: str, expected: str) -> str:
    found = type(value).__module__ + "." + type(value).__qualname__
    hint = (" A torch tensor lives in this process: upload it with dtorch.tensor(t, device_mesh=..., "
            "placements=...) and wrap a parameter in dtorch.nn.Parameter." if is_local_tensor(value) else "")
    return f"cannot assign {found} as {kind} {name!r} ({expected} expected).{hint}"


def _refuse_local_weights(name: str, module) -> None:
    """A torch module whose weights live in this process would fail at its first op, far from
    here; a torch module without tensors (torch.nn.ReLU) works on DTensors and is accepted."""
    if module is None or isinstance(module, Module) or not isinstance(module, torch.nn.Module):
        return
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise TypeError(f"submodule {name!r} is a torch module ({type(module).__name__}) holding local tensors; "
                        f"use the dtorch.nn layer of the same name, which keeps its weights on the workers")
