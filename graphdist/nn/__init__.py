"""gd.nn: the neural-network functions and layers of docs/api.md. The ops' rules live in
graphdist/ops/ (nn.py, conv.py); compositions (moments, batch_normalization) and layers
here; dropout with the random generator (graphdist/random.py); compute_average_loss, which
reads the replica context, in graphdist/distribute/loss.py."""

from graphdist.distribute.loss import compute_average_loss  # noqa: F401
from graphdist.nn.layers import (AvgPool2D, Conv2D, Dense, Dropout, Flatten,  # noqa: F401
                                 Layer, MaxPool2D)
from graphdist.nn.model import Model, Sequential  # noqa: F401
from graphdist.nn.embedding import Embedding, embedding_lookup  # noqa: F401
from graphdist.nn.normalization import (BatchNorm, LayerNorm,  # noqa: F401
                                        batch_normalization, layer_norm, moments)
from graphdist.nn.policy import DTypePolicy  # noqa: F401
from graphdist.nn.recurrent import GRU, LSTM  # noqa: F401
from graphdist.ops.conv import conv2d  # noqa: F401
from graphdist.ops.pool import avg_pool2d, max_pool2d  # noqa: F401
from graphdist.ops.math import relu, sigmoid, tanh  # noqa: F401
from graphdist.ops.nn import (log_softmax, softmax, softmax_cross_entropy,  # noqa: F401
                              sparse_softmax_cross_entropy)
from graphdist.random import dropout  # noqa: F401
from graphdist.nn.attention import MultiHeadAttention  # noqa: F401
from graphdist.ops.attention import causal_mask  # noqa: F401
from graphdist.ops.special import gelu  # noqa: F401
