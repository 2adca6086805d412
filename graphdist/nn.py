"""gd.nn: the neural-network functions of API.md (their rules live in graphdist/ops/nn.py)."""

from graphdist.ops.math import relu, sigmoid, tanh  # noqa: F401
from graphdist.ops.nn import (compute_average_loss, log_softmax, softmax,  # noqa: F401
                              softmax_cross_entropy, sparse_softmax_cross_entropy)
