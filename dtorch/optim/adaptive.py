"""RMSprop, Adagrad and Adadelta: torch.optim's options and checks; the update is torch's own
(torch.optim.rmsprop.rmsprop, adagrad.adagrad, adadelta.adadelta), on the workers."""
from __future__ import annotations

from .checks import check_lr, check_nonnegative
from .optimizer import Optimizer
from .state import init_state

__all__ = ["RMSprop", "Adagrad", "Adadelta"]


class RMSprop(Optimizer):
    kind = "RMSprop"
    hyper_names = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize")

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):
        check_lr(lr)
        check_nonnegative(eps=eps, momentum=momentum, weight_decay=weight_decay, alpha=alpha)
        defaults = {"lr": lr, "momentum": momentum, "alpha": alpha, "eps": eps, "centered": centered,
                    "weight_decay": weight_decay, "capturable": capturable, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable}
        super().__init__(params, defaults)


class Adagrad(Optimizer):
    """As torch's, makes every parameter's state at construction (sum at initial_accumulator_value,
    step 0): one command per parameter, none per step."""
    kind = "Adagrad"
    hyper_names = ("lr", "weight_decay", "lr_decay", "eps", "maximize")

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        check_lr(lr)
        check_nonnegative(lr_decay=lr_decay, weight_decay=weight_decay,
                          initial_accumulator_value=initial_accumulator_value, eps=eps)
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                    "initial_accumulator_value": initial_accumulator_value, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable, "fused": fused}
        super().__init__(params, defaults)
        init_state(self)

    def hyper(self, group: dict) -> dict:
        # torch fills a sum made later (a group added after construction) from the defaults too
        return super().hyper(group) | {"initial_accumulator_value": float(self.defaults["initial_accumulator_value"])}


class Adadelta(Optimizer):
    kind = "Adadelta"
    hyper_names = ("lr", "rho", "eps", "weight_decay", "maximize")

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):
        check_lr(lr)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        check_nonnegative(eps=eps, weight_decay=weight_decay)
        defaults = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay, "maximize": maximize,
                    "capturable": capturable, "foreach": foreach, "differentiable": differentiable}
        super().__init__(params, defaults)
