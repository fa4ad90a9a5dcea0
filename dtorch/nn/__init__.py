"""dtorch.nn: functional ops with torch.nn's names (dtorch.nn.functional.relu, ...)."""
from . import functional

__all__ = ["functional"]
