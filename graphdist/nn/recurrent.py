"""Recurrent layers on gd.scan: gd.nn.LSTM and gd.nn.GRU, with Keras's weight layout, gate
order and defaults (sigmoid gates, tanh activation, orthogonal recurrent kernel, the LSTM's
forget-gate bias at 1, the GRU's reset_after=True with its two bias rows). The input
projection of every timestep is one matmul before the loop; the scan carries the state and
runs one (batch, units) x (units, k*units) matmul per step. One node whatever the sequence
length: it compiles once.
"""

from __future__ import annotations

import numpy as np

from graphdist.nn.layers import Layer, _initial
from graphdist.ops.array import reshape, split, transpose
from graphdist.ops.control_flow import scan
from graphdist.ops.math import add, matmul, multiply, sigmoid, subtract, tanh


def orthogonal(shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Keras's orthogonal initializer: Q of the QR of a normal matrix (signs fixed by R's
    diagonal), so the recurrent kernel neither grows nor shrinks the state at first."""
    from graphdist import initializers

    rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
    flat = initializers.random_normal((max(rows, cols), min(rows, cols)), "float64",
                                      stddev=1.0, seed=seed, generator=generator)
    q, r = np.linalg.qr(flat)
    q = q * np.sign(np.diag(r))
    q = q if rows >= cols else q.T
    return np.ascontiguousarray(q.reshape(shape), dtype)


def _initial_value(initializer, shape, dtype):
    return orthogonal(shape, dtype) if isinstance(initializer, str) and \
        initializer == "orthogonal" else _initial(
        initializer, shape, dtype)


class _Recurrent(Layer):
    """What LSTM and GRU share: the (batch, time, features) input, the input projection of
    every step at once, the scan, and the outputs Keras gives."""

    rank = 3
    gates = 0

    def __init__(self, units: int, return_sequences: bool = False, return_state: bool = False,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", name=None, dtype=None):
        super().__init__(name, dtype)
        self.units = int(units)
        self.return_sequences = bool(return_sequences)
        self.return_state = bool(return_state)
        self.kernel_initializer = kernel_initializer
        self.recurrent_initializer = recurrent_initializer
        self.bias_initializer = bias_initializer

    def build(self, input_shape):
        k = self.gates * self.units
        self.kernel = self.add_weight("kernel", _initial_value(
            self.kernel_initializer, (input_shape[-1], k), self.dtype))
        self.recurrent_kernel = self.add_weight("recurrent_kernel", _initial_value(
            self.recurrent_initializer, (self.units, k), self.dtype))
        self.bias = self.add_weight("bias", self.initial_bias())
        self._fixed_axes = {-1: input_shape[-1]}

    def initial_bias(self) -> np.ndarray:
        return _initial_value(self.bias_initializer, (self.gates * self.units,), self.dtype)

    def call(self, x, training=False):
        batch, steps, features = x.shape
        kernel = self.in_compute_dtype(self.kernel)
        recurrent = self.in_compute_dtype(self.recurrent_kernel)
        bias = self.in_compute_dtype(self.bias)
        time_major = transpose(x, (1, 0, 2))
        projected = reshape(matmul(reshape(time_major, (steps * batch, features)), kernel),
                            (steps, batch, self.gates * self.units))
        zeros = np.zeros((batch, self.units), np.dtype(self.compute_dtype))
        state, ys = scan(lambda s, xw: self.step(s, xw, recurrent, bias),
                         self.initial_state(zeros), projected)
        output = transpose(ys, (1, 0, 2)) if self.return_sequences else state[0]
        return [output, *state] if self.return_state else output


class LSTM(_Recurrent):
    """Keras's LSTM: gates i, f, c, o in that order along the kernels' last axis;
    c = f * c + i * tanh(x W_c + h U_c + b_c), h = o * tanh(c).

    >>> layer = gd.nn.LSTM(8, return_sequences=True); y = layer(np.ones((2, 5, 3), np.float32))
    """

    default_name = "lstm"
    gates = 4

    def initial_bias(self):
        bias = super().initial_bias()
        if isinstance(self.bias_initializer, str) and self.bias_initializer == "zeros":
            # Keras's unit_forget_bias=True
            bias[self.units:2 * self.units] = 1
        return bias

    def initial_state(self, zeros):
        return (zeros, zeros)

    def step(self, state, xw, recurrent, bias):
        h, c = state
        z = add(add(xw, matmul(h, recurrent)), bias)
        i, f, g, o = split(z, 4, axis=1)
        c = add(multiply(sigmoid(f), c), multiply(sigmoid(i), tanh(g)))
        h = multiply(sigmoid(o), tanh(c))
        return (h, c), h


class GRU(_Recurrent):
    """Keras's GRU with reset_after=True (its default): gates z, r, h; the bias has two
    rows, for the input and the recurrent projection; h = z * h + (1 - z) * tanh(x W_h +
    b_h + r * (h U_h + b'_h)).

    >>> layer = gd.nn.GRU(8, return_state=True); out, h = layer(np.ones((2, 5, 3), np.float32))
    """

    default_name = "gru"
    gates = 3

    def initial_bias(self):
        return _initial_value(self.bias_initializer, (2, 3 * self.units), self.dtype)

    def initial_state(self, zeros):
        return (zeros,)

    def step(self, state, xw, recurrent, bias):
        (h,) = state
        input_bias, recurrent_bias = bias[0], bias[1]
        x_z, x_r, x_h = split(add(xw, input_bias), 3, axis=1)
        r_z, r_r, r_h = split(add(matmul(h, recurrent), recurrent_bias), 3, axis=1)
        z = sigmoid(add(x_z, r_z))
        r = sigmoid(add(x_r, r_r))
        candidate = tanh(add(x_h, multiply(r, r_h)))
        h = add(multiply(z, h), multiply(subtract(1.0, z), candidate))
        return (h,), h
