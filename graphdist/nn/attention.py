"""The transformer layers: MultiHeadAttention, with Keras's names, shapes and defaults (and
LayerNorm, whose home is normalization.py). MultiHeadAttention projects with einsum kernels
shaped [d_model, num_heads, key_dim] (Keras's EinsumDense) held by sublayers, so checkpoints
name them query/key/value/attention_output; the ops are gd.einsum and gd.nn.softmax(mask=)."""

from __future__ import annotations

import math

import numpy as np

from graphdist.errors import ShapeError
from graphdist.nn.layers import Dropout, Layer, _dtype, _initial, _shape
from graphdist.nn.normalization import LayerNorm  # noqa: F401  (its home; named here before)
from graphdist.ops.array import cast, expand_dims
from graphdist.ops.attention import causal_mask
from graphdist.ops.construct import arange
from graphdist.ops.einsum import einsum
from graphdist.ops.math import add, greater_equal, multiply, not_equal, where
from graphdist.ops.nn import softmax
from graphdist.trace import name_scope


class _Projection(Layer):
    """y = x . kernel (+ bias), contracting the last `contract` axes of x with the kernel's
    first ones: Keras's EinsumDense for the shapes attention uses."""

    default_name = "einsum_dense"

    def __init__(self, units: tuple, contract: int, use_bias: bool, kernel_initializer,
                 bias_initializer, name: str, dtype=None):
        super().__init__(name, dtype)
        self.units, self.contract, self.use_bias = tuple(units), contract, use_bias
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer
        self.min_rank = contract + 1

    def build(self, input_shape):
        shape = tuple(input_shape[-self.contract:]) + self.units
        self.kernel = self.add_weight("kernel", _initial(self.kernel_initializer, shape,
                                                         self.dtype))
        if self.use_bias:
            self.bias = self.add_weight("bias", _initial(self.bias_initializer, self.units,
                                                         self.dtype))
        self._fixed_axes = {-k: input_shape[-k] for k in range(1, self.contract + 1)}

    def call(self, x, training=False):
        # q/k/v: (..., d) x (d, h, k); the output: (..., h, v) x (h, v, o...)
        inner, outer = ("d", "hk") if self.contract == 1 else ("hv", "opqrs"[:len(self.units)])
        y = einsum(f"...{inner},{inner}{outer}->...{outer}", x, cast(self.kernel, _dtype(x)))
        return add(y, cast(self.bias, _dtype(x))) if self.use_bias else y


class MultiHeadAttention(Layer):
    """Keras's MultiHeadAttention on (batch, length, features) inputs:
    `mha(query, value=None, key=None, attention_mask=None, use_causal_mask=False,
    training=None)`, value defaulting to query and key to value. `attention_mask`
    (batch, query length, key length) is True (or 1) where a query may attend; dropout
    (`dropout` > 0, training only) drops attention probabilities.

    >>> mha = gd.nn.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> mha(np.ones((1, 3, 8), np.float32), use_causal_mask=True).shape
    (1, 3, 8)
    """

    default_name = "multi_head_attention"

    def __init__(self, num_heads: int, key_dim: int, value_dim: int | None = None,
                 dropout: float = 0.0, use_bias: bool = True, output_shape=None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", seed=None,
                 name=None, dtype=None):
        super().__init__(name, dtype)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim) if value_dim is not None else self.key_dim
        if min(self.num_heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"MultiHeadAttention '{self.name}': num_heads, key_dim and "
                             f"value_dim must be positive, got {num_heads}, {key_dim}, "
                             f"{value_dim}")
        self.output_shape = output_shape
        self.use_bias = bool(use_bias)
        self._projection_args = (self.use_bias, kernel_initializer, bias_initializer, dtype)
        self.query_dense = self._projection("query", (self.num_heads, self.key_dim), 1)
        self.key_dense = self._projection("key", (self.num_heads, self.key_dim), 1)
        self.value_dense = self._projection("value", (self.num_heads, self.value_dim), 1)
        self.output_dense = None           # its units are the query's features: first call
        self.dropout_layer = Dropout(dropout, seed=seed, name=f"{self.name}/dropout")

    def _projection(self, name, units, contract):
        use_bias, kernel_initializer, bias_initializer, dtype = self._projection_args
        return _Projection(units, contract, use_bias, kernel_initializer, bias_initializer,
                           name=f"{self.name}/{name}", dtype=dtype)

    def __call__(self, query, value=None, key=None, attention_mask=None,
                 use_causal_mask=False, training=None):
        value = query if value is None else value
        key = value if key is None else key
        shapes = {"query": _shape(query), "value": _shape(value), "key": _shape(key)}
        what = f"MultiHeadAttention '{self.name}'"
        for name, shape in shapes.items():
            if len(shape) != 3:
                raise ShapeError(f"{what}: expected a rank-3 {name} (batch, length, features), "
                                 f"got shape {shape}")
        if (shapes["key"][:2] != shapes["value"][:2]
                or shapes["query"][0] != shapes["value"][0]):
            raise ShapeError(f"{what}: query, key and value need one batch size and key and "
                             f"value one length, got " +
                             ", ".join(f"{k} {v}" for k, v in shapes.items()))
        if self.output_dense is None:
            units = self.output_shape if self.output_shape is not None else shapes["query"][-1]
            units = (units,) if isinstance(units, (int, np.integer)) else tuple(units)
            self.output_dense = self._projection("attention_output", units, 2)
            self.built, self.input_shape = True, shapes["query"]
        return self.call(*(self.in_compute_dtype(t) for t in (query, value, key)),
                         attention_mask, use_causal_mask, bool(training))

    def call(self, query, value, key, attention_mask, use_causal_mask, training):
        # the sublayers' scopes are already "<name>/query", ...: only the rest gets ours
        q = self.query_dense(query)                                     # (B, T, H, K)
        k = self.key_dense(key)                                         # (B, S, H, K)
        v = self.value_dense(value)                                     # (B, S, H, V)
        with name_scope(self.name):
            scores = einsum("bthk,bshk->bhts", multiply(q, 1.0 / math.sqrt(self.key_dim)), k)
            mask = self._mask(attention_mask, use_causal_mask, _shape(query)[1],
                              _shape(key)[1])
            probs = softmax(scores, axis=-1, mask=mask)                 # (B, H, T, S)
        probs = self.dropout_layer(probs, training=training)
        with name_scope(self.name):
            attended = einsum("bhts,bshv->bthv", probs, v)              # (B, T, H, V)
        return self.output_dense(attended)                              # (B, T, out)

    @staticmethod
    def _mask(attention_mask, use_causal_mask, query_length, key_length):
        """(B, 1, T, S) or (T, S) bool, or None: broadcasts over the heads."""
        mask = None
        if attention_mask is not None:
            if _dtype(attention_mask) != np.dtype(bool):
                attention_mask = not_equal(attention_mask, 0)
            mask = expand_dims(attention_mask, 1)
        if use_causal_mask:
            if query_length == key_length:
                causal = causal_mask(query_length)
            else:           # Keras's band_part(ones((T, S)), -1, 0): key <= query
                causal = greater_equal(expand_dims(arange(query_length), 1),
                                       expand_dims(arange(key_length), 0))
            mask = causal if mask is None else where(causal, mask, False)
        return mask


__all__ = ["LayerNorm", "MultiHeadAttention"]
