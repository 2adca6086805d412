"""gd.optimizers: SGD, Adam and AdamW (optimizer.py)."""

from graphdist.optimizers.optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
