"""dtorch.models: model zoo built from dtorch.nn (llama: transformers' LlamaForCausalLM on any
dp/fsdp/pp/cp/tp layout; vision: torchvision's AlexNet and ResNet, data parallel)."""
from . import llama, convnets as vision
from .llama import LlamaForCausalLM
from .convnets import AlexNet, ResNet, resnet18, resnet50

__all__ = ["llama", "vision", "LlamaForCausalLM", "AlexNet", "ResNet", "resnet18", "resnet50"]
