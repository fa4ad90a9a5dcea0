"""BatchNorm2d: torch's module over dtorch's distributed batch statistics. In training mode the
mean and variance span the whole global batch (per-channel sums all-reduced across the ranks that
hold parts of it, as SyncBatchNorm does), and the running statistics are updated in place, without
autograd history, as torch does. In eval mode it is a per-channel affine map."""
from __future__ import annotations

import torch

from ..spec.placements import DeviceMesh, Replicate
from ..dtensor.factories import ones, tensor as upload, zeros
from ..dtensor.recording import no_grad
from . import functional as F
from ._layout import require_mesh
from .module import Module
from .parameter import Parameter

__all__ = ["BatchNorm2d"]


class BatchNorm2d(Module):
    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype: torch.dtype | None = None,
                 device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        mesh = require_mesh(device_mesh, "BatchNorm2d")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        common = dict(dtype=dtype, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
        self.register_parameter("weight", Parameter(ones(num_features, **common)) if affine else None)
        self.register_parameter("bias", Parameter(zeros(num_features, **common)) if affine else None)
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features, **common))
            self.register_buffer("running_var", ones(num_features, **common))
            self.register_buffer("num_batches_tracked", upload(torch.tensor(0), device_mesh=mesh))
        else:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(name, None)
        # batches seen, counted on the controller for momentum=None (the cumulative average's
        # factor, 1 / count): public, so dtorch.compile's guard on module settings sees it change
        self.cumulative_batches = 0

    def forward(self, input):
        if input.ndim != 4:
            raise ValueError(f"BatchNorm2d expects a 4-D input (N, C, H, W), got {input.ndim}-D")
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False,
                                0.0, self.eps)
        momentum = self.momentum
        if self.training and self.track_running_stats:
            with no_grad():   # in place, as torch: a replayed compiled step updates the same buffers
                self.num_batches_tracked.add_(1)
            if momentum is None:
                self.cumulative_batches += 1
                momentum = 1.0 / self.cumulative_batches
        # F.batch_norm updates the running statistics in place without autograd history (they
        # were rebound to outputs that held the step's graph, so the next step's backward
        # reached into this one's: "backward through the graph a second time")
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True,
                            momentum or 0.0, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")
