"""dtorch.nn: modules whose parameters live on a mesh's workers, with torch.nn's and DTorch's
names, parallel styles (parallelize_module), and functional ops (dtorch.nn.functional)."""
from . import functional
from . import multihead  # noqa: F401  (torch.nn.MultiheadAttention's forward on DTensors)
from . import recurrent  # noqa: F401  (torch.nn.RNN / GRU / LSTM and their cells on DTensors)
from . import utils
from .activation import (ELU, GELU, Dropout, Flatten, Identity, LeakyReLU, LogSoftmax, ReLU, Sigmoid, SiLU,
                         Softmax, Softplus, Tanh, Unflatten)
from .batchnorm import BatchNorm2d
from .containers import ModuleDict, ModuleList, Sequential
from .conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .distribute import distribute_module
from .embedding import Embedding, EmbeddingWithReplicateOutput
from .fsdp import fully_shard, set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
from .mixed_precision import MixedPrecisionPolicy, mixed_precision
from .linear import (ColumnParallelLinear, ColumnParallelLinearWithReplicateInputOutput,
                     ColumnParallelLinearWithReplicateOutput, Linear, ReplicateParallelLinear, RowParallelLinear,
                     RowParallelLinearWithReplicateOutput)
from .module import IncompatibleKeys, Module
from .normalization import GroupNorm, LayerNorm, RMSNorm
from .parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                       PrepareModuleOutput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)
from .parameter import Parameter
from .pooling import AdaptiveAvgPool2d, AdaptiveMaxPool2d, AvgPool2d, GlobalAvgPool2d, GlobalMaxPool2d, MaxPool2d

__all__ = ["functional", "utils", "Module", "Parameter", "IncompatibleKeys", "Sequential", "ModuleList", "ModuleDict",
           "Linear", "ColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinearWithReplicateOutput",
           "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinearWithReplicateOutput",
           "ReplicateParallelLinear", "Embedding", "EmbeddingWithReplicateOutput", "LayerNorm", "RMSNorm",
           "GroupNorm", "Dropout", "Identity", "ReLU", "GELU", "SiLU", "Sigmoid", "Tanh", "LeakyReLU", "ELU",
           "Softplus", "Softmax", "LogSoftmax", "Flatten", "Unflatten", "parallelize_module", "ParallelStyle",
           "PrepareModuleInputOutput", "loss_parallel", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "fully_shard", "set_modules_to_forward_prefetch",
           "set_modules_to_backward_prefetch", "distribute_module", "mixed_precision",
           "MixedPrecisionPolicy", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
           "ConvTranspose3d", "BatchNorm2d", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d",
           "GlobalAvgPool2d", "GlobalMaxPool2d"]
