"""gd.optimizers: SGD, Adam and AdamW (optimizer.py); LossScaleOptimizer (loss_scale.py);
learning-rate schedules (schedules.py, as gd.optimizers.schedules)."""

from graphdist.optimizers import schedules
from graphdist.optimizers.loss_scale import LossScaleOptimizer
from graphdist.optimizers.optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "LossScaleOptimizer", "schedules"]
