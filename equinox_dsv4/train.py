"""`equinox_dsv4.train`: losses, load balancing, optimizer, train step and train state (the
same names are also exported from `equinox_dsv4`)."""

from ._model import REMAT_POLICIES as REMAT_POLICIES
from ._moe import RouterStats as RouterStats
from ._train import (
    Batch as Batch,
    TrainState as TrainState,
    balance_loss as balance_loss,
    cross_entropy as cross_entropy,
    init_train_state as init_train_state,
    loss_and_stats as loss_and_stats,
    make_optimizer as make_optimizer,
    make_train_step as make_train_step,
    restore_train_state as restore_train_state,
    save_train_state as save_train_state,
    trainable as trainable,
    update_router_bias as update_router_bias,
)
