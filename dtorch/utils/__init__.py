"""dtorch.utils: torch.utils' tools that work on DTensors (activation checkpointing)."""
from . import checkpoint

__all__ = ["checkpoint"]
