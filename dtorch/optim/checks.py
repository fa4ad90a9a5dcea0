"""torch.optim's argument checks, with its messages; each optimizer calls them in torch's order,
so that the first bad argument is the one torch names."""
from __future__ import annotations

import torch

__all__ = ["check_lr", "check_nonnegative", "check_betas", "check_adam_like"]

_LABELS = {"lr": "learning rate", "eps": "epsilon value"}


def check_lr(lr) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    check_nonnegative(lr=lr)


def check_nonnegative(**values) -> None:
    """torch's `if not 0.0 <= value` (a NaN fails it too), named as torch names each."""
    for name, value in values.items():
        if not 0.0 <= value:
            raise ValueError(f"Invalid {_LABELS.get(name, name + ' value')}: {value}")


def check_betas(betas) -> None:
    for index in (0, 1):
        if not 0.0 <= betas[index] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {betas[index]}")


def check_adam_like(lr, betas, eps, weight_decay) -> None:
    """The checks torch's Adam, Adamax, NAdam and RAdam share, in their order."""
    check_lr(lr)
    check_nonnegative(eps=eps)
    check_betas(betas)
    check_nonnegative(weight_decay=weight_decay)
