"""`x.retain_grad()` on an intermediate (an op's output that requires grad): its gradient is kept
by the backward passes that reach it, as torch keeps it, and read as `x.grad`.

The workers do the keeping: a Backward command lists the retained tensors among its inputs, and
each worker calls torch's own `retain_grad()` on its local tensor before its engine runs, so the
local `.grad` accumulates across backward calls exactly as torch's does. The controller's part
is a leaf's: a DTensor symbol for that gradient, in gradient placements (a Replicate
intermediate's gradient is a pending P(sum) until read, autograd/placement_rules.py), reduced to the
tensor's own placements when `x.grad` is read.
"""
from __future__ import annotations

from ..dtensor import compile_capture as capturing
from ..errors import user_site
from ..ops.tensor_meta import tensor_meta
from ..dtensor.recording import HopNode, Leaf, RetainedGrad, no_grad
from ..runtime.protocol import SetGrads
from ..dtensor.tensor import DTensor
from .placement_rules import gradient_placements

__all__ = ["retain_grad", "retains_grad", "retained_in", "retained_accumulator", "retained_grad",
           "clear_retained"]


def retain_grad(tensor: DTensor) -> None:
    """torch.Tensor.retain_grad: a leaf keeps its gradient anyway; an intermediate keeps it from
    the next backward that reaches it on."""
    node = tensor._node
    if node is None:
        raise RuntimeError(f"retain_grad at {user_site()}: can't retain_grad on Tensor that has requires_grad=False")
    if type(node) is Leaf:
        return
    if type(node) is HopNode:
        raise NotImplementedError(f"retain_grad at {user_site()}: the gradient of a tensor moved to another mesh "
                                  "(a pipeline stage's input) is not kept; retain the tensor before the move")
    gradient_placements(tensor.placements)   # a P(max|min) tensor has none: refused here, not in backward
    if node.retained is None:
        node.retained = {}
    node.retained.setdefault(tensor._id, RetainedGrad(tensor))


def retains_grad(tensor: DTensor) -> bool:
    """torch.Tensor.retains_grad: True for an intermediate after retain_grad(), else False."""
    return _record_of(tensor) is not None


def _record_of(tensor: DTensor) -> RetainedGrad | None:
    node = tensor._node
    if type(node) in (type(None), Leaf, HopNode) or not node.retained:
        return None
    return node.retained.get(tensor._id)


def retained_in(nodes: list) -> list[tuple[DTensor, RetainedGrad]]:
    """(tensor, record) of every retained output of `nodes` (a backward's walk) still alive."""
    found = []
    for node in nodes:
        for record in (node.retained or {}).values():
            tensor = record.tensor()
            if tensor is not None:
                found.append((tensor, record))
    if found and capturing.active() is not None:
        raise NotImplementedError(f"backward at {user_site()}: retain_grad() inside a dtorch.compile'd function is "
                                  "not supported; return dtorch.autograd.grad(loss, [intermediate]) instead")
    return found


def retained_accumulator(tensor: DTensor, record: RetainedGrad) -> DTensor:
    """The DTensor the backward accumulates the intermediate's gradient into, in gradient
    placements: the current one (moved back to them first if a read reduced it), or a new one."""
    wanted = gradient_placements(tensor.placements)
    if record.grad is not None and record.bound != record.grad._id:   # `x.grad.mul_(2)` rebound it here only
        _bind(tensor, record, record.grad)
    if record.grad is None:
        controller = tensor._controller
        record.grad = DTensor(controller.new_id(), tensor_meta(tensor.shape, tensor.dtype, tensor.device_mesh,
                                                               wanted), -1, controller)
    elif record.grad.placements != wanted:
        with no_grad():
            _bind(tensor, record, record.grad.redistribute(placements=wanted))
    return record.grad


def retained_grad(tensor: DTensor):
    """`x.grad` of an intermediate: None unless retained and reached by a backward; reduced to
    the tensor's own placements on first read (and the workers' .grad rebound to it)."""
    record = _record_of(tensor)
    if record is None or record.grad is None:
        return None
    if record.grad.placements != tensor.placements:
        with no_grad():
            _bind(tensor, record, record.grad.redistribute(placements=tensor.placements))
    return record.grad


def clear_retained(tensor: DTensor) -> None:
    """`x.grad = None` on a retained intermediate: the next backward starts from zero."""
    record = _record_of(tensor)
    if record is not None and record.grad is not None:
        record.grad = record.bound = None
        tensor._controller.submit(SetGrads, (tensor._id,), (-1,))


def _bind(tensor: DTensor, record: RetainedGrad, grad: DTensor) -> None:
    tensor._controller.submit(SetGrads, (tensor._id,), (grad._id,))
    record.grad, record.bound = grad, grad._id
