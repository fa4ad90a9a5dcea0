"""Adam and AdamW: torch.optim's options and checks; the update is torch's own (adam with
decoupled_weight_decay for AdamW, as torch.optim.AdamW runs it), on the workers."""
from __future__ import annotations

import torch

from .checks import check_adam_like
from .optimizer import Optimizer

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    kind = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):
        check_adam_like(lr, betas, eps, weight_decay)
        betas = tuple([float(b.item() if isinstance(b, torch.Tensor) else b) for b in betas])
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults)
        if decoupled_weight_decay:
            self.kind = "AdamW"

    def hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "betas": (float(beta1), float(beta2)), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]), "amsgrad": bool(group["amsgrad"]),
                "maximize": bool(group["maximize"]),
                "decoupled_weight_decay": bool(group.get("decoupled_weight_decay", self.kind == "AdamW")),
                **self.path(group)}


class AdamW(Adam):
    kind = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
