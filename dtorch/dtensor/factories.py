"""Factories with device_mesh= and placements=: each worker builds only its own shard.

Random factories are counter-based (see dtorch/spec/rng.py): values depend on the seed, the call
order, the global shape and the dtype — never on the mesh or the placements.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..spec.placements import (DeviceMesh, Placement, Replicate, holds_partial_sum_value, init_device_mesh,
                               local_region, narrow_to_box)
from ..errors import DTorchError, ShapeError, user_site
from ..ops.conversions import check_new_device
from ..ops.tensor_meta import check_placements, parse_shape, tensor_meta
from ..spec.rng import Generator
from ..runtime.controller import session
from ..runtime.protocol import Factory, Upload, dtype_name, tensor_frame
from . import api
from .tensor import DTensor

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye", "tensor",
           "Tensor", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"]


def _layout(shape, device_mesh: DeviceMesh | None, placements):
    if device_mesh is None:
        raise DTorchError("pass device_mesh=: e.g. init_device_mesh('cpu', (4,)); dtorch has no implicit mesh")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    return check_placements(placements, len(shape), device_mesh)


def _factory(kind: str, shape, dtype, device_mesh, placements, args=(), requires_grad: bool = False) -> DTensor:
    placements = _layout(shape, device_mesh, placements)
    dtype = dtype or torch.get_default_dtype()
    spec = tensor_meta(shape, dtype, device_mesh, placements)
    controller = session.controller()
    out_id = controller.new_id()
    seq = controller.submit(Factory, out_id, controller.define_mesh(device_mesh), kind, shape, dtype_name(dtype),
                       placements, tuple(args))
    made = DTensor(out_id, spec, seq, controller)
    return made.requires_grad_() if requires_grad else made


def zeros(*size, dtype=None, device_mesh=None, requires_grad=False,
          placements: Sequence[Placement] | None = None) -> DTensor:
    return _factory("zeros", parse_shape(size), dtype, device_mesh, placements, requires_grad=requires_grad)


def ones(*size, dtype=None, device_mesh=None, requires_grad=False, placements=None) -> DTensor:
    return _factory("ones", parse_shape(size), dtype, device_mesh, placements, requires_grad=requires_grad)


def empty(*size, dtype=None, device_mesh=None, requires_grad=False, placements=None) -> DTensor:
    return _factory("empty", parse_shape(size), dtype, device_mesh, placements, requires_grad=requires_grad)


def full(size, fill_value, *, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _factory("full", parse_shape((size,)), dtype, device_mesh, placements, (fill_value,), requires_grad)


def _random_call(generator) -> tuple[int, int]:
    """(seed, counter) of the next random call: from `generator`, or the global stream."""
    if generator is None:
        return session.next_random()
    if not isinstance(generator, Generator):
        raise TypeError(f"generator= takes a dtorch.Generator, not {type(generator).__name__}: a torch.Generator's "
                        "values depend on how many elements one process draws, so they cannot be made per "
                        "shard; use dtorch.Generator().manual_seed(seed)")
    return generator.next_call()


def _floating_only(name: str, dtype) -> None:
    """torch draws rand and randn in floating and complex dtypes only, and says so at the call."""
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        kernel = "check_uniform_bounds" if name == "rand" else "normal_kernel_cpu"
        raise ShapeError(f"{name}(dtype={dtype}) at {user_site()}: \"{kernel}\" not implemented for "
                         f"'{str(dtype)[6:]}' (torch draws {name} in floating-point dtypes only); for integers "
                         f"write dtorch.randint(low, high, size, dtype={dtype})")


def rand(*size, generator=None, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    _floating_only("rand", dtype)
    return _factory("rand", parse_shape(size), dtype, device_mesh, placements, _random_call(generator), requires_grad)


def randn(*size, generator=None, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    _floating_only("randn", dtype)
    return _factory("randn", parse_shape(size), dtype, device_mesh, placements, _random_call(generator), requires_grad)


def randint(low, high=None, size=None, *, generator=None, dtype=torch.int64, device_mesh=None,
            placements=None) -> DTensor:
    if high is None:
        low, high = 0, low
    if size is None:
        raise DTorchError("randint needs size=")
    return _factory("randint", parse_shape((size,)), dtype, device_mesh, placements,
                    _random_call(generator) + (int(low), int(high)))


def arange(start, end=None, step=1, *, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    if end is None:
        start, end = 0, start
    reference = torch.arange(start, end, step, dtype=dtype, device="meta")
    return _factory("arange", tuple(reference.shape), reference.dtype, device_mesh, placements, (start, step),
                    requires_grad)


def linspace(start, end, steps: int, *, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    return _factory("linspace", (int(steps),), dtype, device_mesh, placements, (start, end), requires_grad)


def eye(n: int, m: int | None = None, *, dtype=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    return _factory("eye", (int(n), int(n if m is None else m)), dtype, device_mesh, placements, (), requires_grad)


def tensor(data, *, dtype=None, device=None, device_mesh=None, placements=None, requires_grad=False) -> DTensor:
    """Upload a local tensor: each worker receives only its own shard (private frames). Without
    device_mesh it lands on a one-device mesh (one worker of `device`'s type, "cpu" by default),
    which ops with tensors of another mesh treat as a constant (dtorch/ops/one_device.py)."""
    value = _owned(torch.as_tensor(data, dtype=dtype).detach().cpu(), data)
    shape = tuple(value.shape)
    device_mesh = _mesh_or_one_device(device, device_mesh)
    placements = _layout(shape, device_mesh, placements)
    spec = tensor_meta(shape, value.dtype, device_mesh, placements)
    controller = session.controller()
    private = [(rank, tensor_frame(_shard_for(value, device_mesh, placements, rank)))
               for rank in device_mesh.ranks]
    out_id = controller.new_id()
    seq = controller.submit(Upload, out_id, controller.define_mesh(device_mesh), shape, dtype_name(value.dtype),
                            placements, private=private)
    made = DTensor(out_id, spec, seq, controller)
    return made.requires_grad_() if requires_grad else made


def upload_replicated(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A local torch tensor uploaded Replicate on every dim of `mesh`: an op's constant argument
    (dtensor/op_issue.py calls it through the seam below), a mask, a torch module's parameter."""
    return tensor(local, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)


api.register_method("_upload_constant", staticmethod(upload_replicated))


def _owned(value: torch.Tensor, data) -> torch.Tensor:
    """`value`, copied if it may share memory with the caller's `data` (a torch tensor, a numpy
    array): the frames are sent later, by the loop thread, and a caller that refills its buffer
    in place right after the call (a reused batch buffer) must not change what was uploaded."""
    if isinstance(data, (list, tuple, int, float, bool, complex)):
        return value   # as_tensor built a new tensor
    if isinstance(data, torch.Tensor) and value.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        return value   # already a copy (another dtype or device)
    return value.clone()


def distribute_tensor(data, /, device_mesh: DeviceMesh | None = None, placements=None, *, src_data_rank=0) -> DTensor:
    """torch.distributed.tensor's spelling of `tensor`: each worker receives only its shard of the
    controller's tensor. There is one source, the controller, so `src_data_rank` has nothing to
    choose (it is accepted for torch's signature). As in torch, the result requires grad (a leaf)
    when `data` does."""
    if isinstance(data, DTensor):
        raise DTorchError(f"distribute_tensor: {data} is already distributed; move it with "
                          "x.redistribute(device_mesh=..., placements=[...])")
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"distribute_tensor takes a torch.Tensor, not {type(data).__name__} (dtorch.tensor "
                        "takes lists and numbers)")
    return tensor(data, device_mesh=device_mesh, placements=placements, requires_grad=data.requires_grad)


def _mesh_or_one_device(device, device_mesh: DeviceMesh | None) -> DeviceMesh:
    if device is not None and device_mesh is not None:
        raise DTorchError("pass device= or device_mesh=, not both (device= means a one-device mesh)")
    return device_mesh if device_mesh is not None else init_device_mesh(torch.device(device or "cpu").type, 1)


class _TensorType(type):
    """dtorch.Tensor is DTorch's spelling: calling it makes a DTensor (an upload, or empty values
    for sizes), and isinstance(x, dtorch.Tensor) holds for every DTensor, so code that checks for
    DTorch's Tensor keeps working."""

    def __instancecheck__(cls, value) -> bool:
        return isinstance(value, DTensor)

    def __subclasscheck__(cls, subclass) -> bool:
        return isinstance(subclass, type) and issubclass(subclass, DTensor)

    def __call__(cls, *args, dtype=None, device=None, device_mesh=None, placements=None,
                 requires_grad=False) -> DTensor:
        if len(args) == 1 and isinstance(args[0], DTensor):   # DTorch's copy constructor: the same tensor
            return _existing(args[0], dtype, device, device_mesh, placements, requires_grad)
        sizes = _sizes(args)
        if sizes is not None:   # Tensor(), Tensor(2, 3), Tensor(torch.Size([2, 3])): uninitialized, as torch's
            mesh = _mesh_or_one_device(device, device_mesh)
            return empty(*sizes, dtype=dtype, device_mesh=mesh, placements=placements, requires_grad=requires_grad)
        if len(args) != 1:
            raise TypeError(f"dtorch.Tensor takes sizes (ints or a torch.Size) or one data argument, not "
                            f"{', '.join(type(a).__name__ for a in args)}")
        data = args[0]
        if not isinstance(data, torch.Tensor) and dtype is None:   # torch.Tensor([1, 2]) is float, as DTorch's
            dtype = torch.get_default_dtype()
        return tensor(data, dtype=dtype, device=device, device_mesh=device_mesh, placements=placements,
                      requires_grad=requires_grad)


class Tensor(metaclass=_TensorType):
    """DTorch's (and torch's) constructor forms, each a DTensor (type(x) is DTensor; isinstance(x,
    dtorch.Tensor) and isinstance(x, torch.Tensor) are True), on `device_mesh=` in `placements=`, or
    without them on a one-device mesh (`device=`'s type, "cpu" by default):

      dtorch.Tensor(torch_tensor)        an upload like dtorch.tensor, in the tensor's dtype
      dtorch.Tensor([[1, 2], [3, 4]])    data (a list, tuple, number or numpy array): an upload in
                                         the default float dtype, as torch.Tensor (dtype= to choose)
      dtorch.Tensor(2, 3), dtorch.Tensor(torch.Size([2, 3]))
                                         uninitialized values of that shape (dtorch.empty), float
      dtorch.Tensor()                    an empty float tensor of shape (0,)
      dtorch.Tensor(dtensor)             that DTensor itself (DTorch's copy constructor shares it);
                                         moved with device_mesh= / placements=, cast with dtype=
    """


def _sizes(args: tuple):
    """The shape when `args` are sizes (torch.Tensor's size forms), else None (data)."""
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return tuple(args[0])
    if all(type(a) is int for a in args):   # () too: Tensor() is empty; a bool is data, as in torch
        return args if args else (0,)
    return None


def _existing(x: DTensor, dtype, device, device_mesh, placements, requires_grad) -> DTensor:
    if device is not None:
        raise DTorchError(f"dtorch.Tensor(dtensor, device={device!r}): {x} already lives on a mesh; move it with "
                          "device_mesh= (and placements=), or x.to(mesh)")
    if device_mesh is not None or placements is not None:
        x = x.redistribute(device_mesh, placements)
    if dtype is not None:
        x = x.to(dtype)
    return x.requires_grad_() if requires_grad else x


def _shard_for(value: torch.Tensor, mesh: DeviceMesh, placements, rank: int) -> torch.Tensor:
    coordinate = mesh.coordinate_of(rank)
    shard = narrow_to_box(value, *local_region(value.shape, mesh, placements, coordinate))
    return shard.contiguous() if holds_partial_sum_value(placements, coordinate) else torch.zeros_like(shard)


def _like(factory):
    def make(other: DTensor, *args, dtype=None, device_mesh=None, placements=None, **extra):
        return factory(*((tuple(other.shape),) + args), dtype=dtype or other.dtype,
                       device_mesh=device_mesh or other.device_mesh,
                       placements=placements if placements is not None else _no_partial(other.placements), **extra)
    make.__name__ = make.__qualname__ = f"{factory.__name__}_like"
    return make


def _no_partial(placements):
    return [Replicate() if p.is_partial() else p for p in placements]


zeros_like, ones_like, empty_like, rand_like, randn_like = map(_like, (zeros, ones, empty, rand, randn))


def full_like(other: DTensor, fill_value, *, dtype=None, device_mesh=None, placements=None,
              requires_grad=False) -> DTensor:
    return full(tuple(other.shape), fill_value, dtype=dtype or other.dtype,
                device_mesh=device_mesh or other.device_mesh,
                placements=placements if placements is not None else _no_partial(other.placements),
                requires_grad=requires_grad)


def _torch_spelling(like):
    """torch.zeros_like(dtensor, ...) and its kin through __torch_function__: torch's keywords a
    mesh makes moot (layout, memory_format, pin_memory, the mesh's own device) are dropped."""
    def make(input, *args, dtype=None, layout=None, device=None, requires_grad=False, memory_format=None,
             pin_memory=False, **extra):
        if device is not None and torch.device(device).type != input.device_mesh.device_type:
            raise DTorchError(f"{like.__name__}(..., device={device!r}): the tensor lives on a "
                              f"{input.device_mesh.device_type} mesh; build on another mesh with device_mesh=")
        return like(input, *args, dtype=dtype, requires_grad=requires_grad, **extra)
    make.__name__ = like.__name__
    return make


api.register_functions({like.__name__: _torch_spelling(like) for like in (zeros_like, ones_like, empty_like, rand_like,
                                                                         randn_like, full_like)})


def _torch_eye(n: int, m: int | None = None, *, out=None, dtype=None, layout=None, device=None, requires_grad=False,
               pin_memory=False):
    """torch.eye(n, m, out=dtensor), as torch.nn.init.eye_ writes it: the identity into `out`, in
    place, made on its workers in its layout. Without out= there is no mesh to make it on."""
    if out is None:
        raise DTorchError("torch.eye reached dtorch without out=: make the identity with dtorch.eye(n, m, "
                          "device_mesh=..., placements=...)")
    made = eye(n, m, dtype=out.dtype, device_mesh=out.device_mesh, placements=_no_partial(out.placements))
    return out.copy_(made)


api.register_function("eye", _torch_eye)


def _new_tensor(self: DTensor, data, dtype=None, device=None, requires_grad: bool = False):
    """torch's x.new_tensor: `data` in x's dtype, on x's mesh (Replicate), also with device= a
    device of the mesh's type. With device="cpu", a plain torch tensor in this process: torch.nn.init
    casts its bounds that way (`x.new_tensor(a, device="cpu").item()`). Another device type
    refuses with what to write."""
    dtype = self.dtype if dtype is None else dtype
    if device is not None and torch.device(device).type == "cpu":
        return torch.tensor(data, dtype=dtype, device=device, requires_grad=requires_grad)
    check_new_device(device, self.device_mesh, f"x.new_tensor(..., device={str(device)!r})", "dtorch.tensor")
    return tensor(data, dtype=dtype, device_mesh=self.device_mesh, placements=[Replicate()] * self.device_mesh.ndim,
                  requires_grad=requires_grad)


api.register_method("new_tensor", _new_tensor)   # here, not in dtensor/tensor.py: it builds with this module's upload


