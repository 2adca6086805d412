"""Embeddings: `embedding_lookup` and the `Embedding` layer. Both are a gather of table
rows, so the table's gradient is row-sparse (gd.IndexedSlices): only the looked-up rows
cross replicas and are updated (graphdist/ops/sparse.py, distribute/sparse.py)."""

from __future__ import annotations

import numpy as np

from graphdist.nn.layers import Layer, _initial
from graphdist.ops.naming import user_op
from graphdist.ops.sparse import gather


@user_op("embedding_lookup")
def embedding_lookup(params, ids):
    """Rows of `params` (a [vocab, dim] table) at `ids` (any shape of integers): shape
    ids.shape + (dim,), as tf.nn.embedding_lookup with one table. Out-of-range ids raise.

    >>> gd.nn.embedding_lookup(np.eye(3), np.array([[2, 0]])).shape
    (1, 2, 3)
    """
    return gather(params, ids)


class Embedding(Layer):
    """Keras's Embedding: integer ids -> rows of an (input_dim, output_dim) table, made on
    the first call with `embeddings_initializer` (Keras's default: uniform in +-0.05).

    >>> layer = gd.nn.Embedding(100, 16); layer(np.array([[3, 7, 7]])).shape
    (1, 3, 16)
    """

    default_name = "embedding"

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer="uniform",
                 name=None):
        super().__init__(name)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        if self.input_dim < 1 or self.output_dim < 1:
            raise ValueError(f"Embedding: input_dim and output_dim must be positive, got "
                             f"{input_dim}, {output_dim}")
        self.embeddings_initializer = embeddings_initializer

    def __call__(self, ids, training=False):
        dtype = np.dtype(ids.dtype) if hasattr(ids, "dtype") else np.asarray(ids).dtype
        if dtype.kind not in "iu":
            raise TypeError(f"Embedding '{self.name}': ids must be integers, got {dtype}; "
                            "use gd.cast(ids, 'int32')")
        return super().__call__(ids, training)

    def build(self, input_shape):
        self.dtype = np.dtype(np.float32)      # the ids' dtype says nothing about the table's
        self.embeddings = self.add_weight("embeddings", _initial(
            self.embeddings_initializer, (self.input_dim, self.output_dim), self.dtype))

    def call(self, ids, training=False):
        # the rows in the compute dtype (mixed precision); the gather reads the variable
        # itself, so its gradient stays sparse
        return self.in_compute_dtype(embedding_lookup(self.embeddings, ids))
