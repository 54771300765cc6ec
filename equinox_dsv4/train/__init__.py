"""`equinox_dsv4.train`: training.

The losses (next-token, MTP, sequence-wise balance; the DSpark drafter's on a frozen trunk) and
the auxiliary-loss-free router-bias update, the optimizer, the jitted train steps with
rematerialisation and gradient accumulation, train states (fresh, abstract for ahead-of-time
compiles, saved and restored), and the useful FLOPs that MFU figures divide by.

May import: config, quant, execution, nn, parallel.
"""

from ..execution import REMAT_POLICIES as REMAT_POLICIES
from ._dspark import DSparkObjective as DSparkObjective, dspark_loss as dspark_loss
from ._flops import (
    active_parameters as active_parameters,
    forward_flops as forward_flops,
    train_flops as train_flops,
)
from ._losses import (
    Batch as Batch,
    TrainState as TrainState,
    balance_loss as balance_loss,
    cross_entropy as cross_entropy,
    loss_and_stats as loss_and_stats,
    trainable as trainable,
    update_router_bias as update_router_bias,
)
from ._state import restore_train_state as restore_train_state, save_train_state as save_train_state
from ._step import (
    TrainStep as TrainStep,
    abstract_train_state as abstract_train_state,
    init_train_state as init_train_state,
    make_optimizer as make_optimizer,
    make_train_step as make_train_step,
)


__all__ = [
    "Batch",
    "TrainState",
    "TrainStep",
    "make_optimizer",
    "make_train_step",
    "DSparkObjective",
    "dspark_loss",
    "init_train_state",
    "abstract_train_state",
    "save_train_state",
    "restore_train_state",
    "trainable",
    "loss_and_stats",
    "cross_entropy",
    "balance_loss",
    "update_router_bias",
    "REMAT_POLICIES",
    "forward_flops",
    "train_flops",
    "active_parameters",
]
