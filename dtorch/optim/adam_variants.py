"""Adamax, NAdam and RAdam: torch.optim's options and checks; the update is torch's own
(torch.optim.adamax.adamax, nadam.nadam, radam.radam), on the workers. NAdam's mu_product is a
0-d buffer, Replicate on the parameter's mesh (optim_kernels.SCALAR_STATE)."""
from __future__ import annotations

from .checks import check_adam_like, check_nonnegative
from .optimizer import Optimizer

__all__ = ["Adamax", "NAdam", "RAdam"]


class Adamax(Optimizer):
    kind = "Adamax"
    hyper_names = ("betas", "eps", "lr", "weight_decay", "maximize")

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False):
        check_adam_like(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable, "capturable": capturable}
        super().__init__(params, defaults)


class NAdam(Optimizer):
    kind = "NAdam"
    hyper_names = ("betas", "lr", "weight_decay", "momentum_decay", "eps", "decoupled_weight_decay", "maximize")

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False):
        check_adam_like(lr, betas, eps, weight_decay)
        check_nonnegative(momentum_decay=momentum_decay)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "momentum_decay": momentum_decay, "decoupled_weight_decay": decoupled_weight_decay,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable}
        super().__init__(params, defaults)


class RAdam(Optimizer):
    kind = "RAdam"
    hyper_names = ("betas", "lr", "weight_decay", "eps", "decoupled_weight_decay", "maximize")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False,
                 *, foreach=None, maximize=False, capturable=False, differentiable=False):
        check_adam_like(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize,
                    "foreach": foreach, "capturable": capturable, "decoupled_weight_decay": decoupled_weight_decay,
                    "differentiable": differentiable}
        super().__init__(params, defaults)
