"""RL and SFT train steps on a trainer mesh: batch structures, optimizer, state, the jitted `Trainer`."""

from rlax.trainer.batch import RolloutBatch, SFTBatch, response_loss_mask
from rlax.trainer.optimizer import OptimizerConfig, make_optimizer, make_schedule
from rlax.trainer.objective import LossInputs, batch_advantages, loss_inputs, reduce_metrics, rl_loss
from rlax.trainer.state import TrainState, accumulate_gradients, apply_gradients, split_micro_batches
from rlax.trainer.trainer import Trainer, sft_loss
