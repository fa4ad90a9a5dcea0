"""dtorch.optim: torch.optim's SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam and
RAdam over DTensor parameters. State lives on the workers, sharded like each parameter; a step is
one command per param group and mesh, running torch's own update on the local shards
(docs/design/training.md, "Optimizers")."""
from .adam import Adam, AdamW
from .adam_variants import Adamax, NAdam, RAdam
from .adaptive import Adadelta, Adagrad, RMSprop
from .optimizer import Optimizer
from .sgd import SGD
from .state import init_state

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
           "init_state"]
