"""dtorch.models: model zoo built from dtorch.nn (llama: transformers' LlamaForCausalLM on any
dp/fsdp/pp/cp/tp layout)."""
from . import llama
from .llama import LlamaForCausalLM

__all__ = ["llama", "LlamaForCausalLM"]
