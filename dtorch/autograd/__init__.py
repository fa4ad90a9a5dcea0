"""dtorch.autograd: backward() and grad() over DTensors, grad mode, and the gradient placement
rules (docs/design/autograd.md). Installs DTensor.backward, DTensor.grad and DTensor.retain_grad."""
from __future__ import annotations

from ..dtensor.recording import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ..dtensor import api
from .engine import backward, backward_stages, grad, leaf_grad, no_sync, reduce_gradients, set_leaf_grad
from .retained import retain_grad, retains_grad
from . import hooks as _hooks  # noqa: F401  (installs x.register_hook, x.register_post_accumulate_grad_hook)
from .placement_rules import gradient_placements

__all__ = ["backward", "backward_stages", "grad", "reduce_gradients", "no_sync", "no_grad", "enable_grad",
           "set_grad_enabled", "is_grad_enabled", "gradient_placements"]


def _tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """x.backward(gradient=None): gradients accumulate into the leaves' .grad (torch's semantics;
    the placements each gradient has: dtorch/autograd/placement_rules.py)."""
    backward([self], None if gradient is None else [gradient], retain_graph, create_graph, inputs)


def _torch_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
                allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """torch.autograd.grad called on DTensors: torch hands the call to __torch_function__ with its
    own keywords (only_inputs is deprecated and ignored, as in torch)."""
    if is_grads_batched:
        raise NotImplementedError("torch.autograd.grad(is_grads_batched=True) (vmap over grad_outputs) is not "
                                  "supported on DTensors; call grad once per grad_outputs")
    return grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads)


api.register_method("backward", _tensor_backward)
# torch.autograd.grad / torch.autograd.backward on DTensors (both check __torch_function__)
api.register_functions(dict(grad=_torch_grad, backward=backward))
api.register_method("grad", property(leaf_grad, set_leaf_grad,
                                     doc="The accumulated gradient, in this tensor's placements (None before "
                                         "a backward reaches it); leaves that require grad keep one, and "
                                         "intermediates after retain_grad()."))
api.register_method("retain_grad", retain_grad)
api.register_method("retains_grad", property(retains_grad, doc="True for an intermediate after retain_grad()."))
