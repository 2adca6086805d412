"""gd.nn: the neural-network functions of API.md (their rules live in graphdist/ops/nn.py;
compute_average_loss, which reads the replica context, in graphdist/distribute/loss.py)."""

from graphdist.distribute.loss import compute_average_loss  # noqa: F401
from graphdist.ops.math import relu, sigmoid, tanh  # noqa: F401
from graphdist.ops.nn import (log_softmax, softmax, softmax_cross_entropy,  # noqa: F401
                              sparse_softmax_cross_entropy)
