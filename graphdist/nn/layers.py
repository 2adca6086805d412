"""gd.nn layers with Keras's names and defaults: Dense, Conv2D, MaxPool2D, AvgPool2D, Dropout,
Flatten (the normalization layers are in normalization.py; Model and Sequential, which
train, in model.py). Thin wrappers over the ops: a layer makes its variables on its
first call (from the input shape) under the current strategy, with concrete initial values
even inside a trace (as optimizer slots are made during the first trace).
Checkpoints find them through `_checkpoint_children` (structural names, not layer names)."""

from __future__ import annotations

import functools
import itertools
import re
import threading

import numpy as np

from graphdist import initializers
from graphdist.distribute.values import VariableAggregation, VariableSynchronization
from graphdist.errors import CheckpointError, ShapeError
from graphdist.ir.types import is_float
from graphdist.nn.policy import dtype_policy
from graphdist.ops.array import cast, reshape
from graphdist.ops.conv import conv2d
from graphdist.ops.pool import avg_pool2d, max_pool2d
from graphdist.ops.math import add, matmul, relu, sigmoid, tanh
from graphdist.random import Generator, dropout
from graphdist.trace import name_scope
from graphdist.variables import Variable

_names: dict[str, itertools.count] = {}
_names_lock = threading.Lock()


def _unique_name(base: str) -> str:
    """Keras-style: 'dense', 'dense_1', 'dense_2', ... per base name, for this process."""
    with _names_lock:
        n = next(_names.setdefault(base, itertools.count()))
    return base if n == 0 else f"{base}_{n}"


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _activation(name_or_fn):
    if name_or_fn is None or callable(name_or_fn):
        return name_or_fn
    from graphdist.ops.nn import softmax

    table = {"linear": None, "relu": relu, "tanh": tanh, "sigmoid": sigmoid, "softmax": softmax}
    if name_or_fn not in table:
        raise ValueError(f"unknown activation {name_or_fn!r}; use one of {sorted(table)} or a "
                         "callable")
    return table[name_or_fn]


def _initial(initializer, shape: tuple, dtype) -> np.ndarray:
    """A string names a gd.initializers function; it or a callable is called as Keras does,
    fn(shape, dtype=dtype), and must give a concrete array (gd.initializers draw now, even
    inside a trace); anything else is taken as the value."""
    if isinstance(initializer, str):
        fn = getattr(initializers, initializer, None) if initializer in initializers.__all__ \
            else None
        if fn is None:
            raise ValueError(f"unknown initializer {initializer!r}; use a gd.initializers name "
                             f"({', '.join(initializers.__all__)}) or a callable")
        initializer = fn
    shape = tuple(int(d) for d in shape)
    value = np.asarray(initializer(shape, dtype=dtype) if callable(initializer)
                       else initializer, dtype)
    if value.shape != tuple(shape):
        raise ValueError(f"initializer gave shape {value.shape}, the weight needs {tuple(shape)}")
    return value


def _pair(where: str, value) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or any(int(v) < 1 for v in pair):
        raise ValueError(f"{where}: expected a positive int or a pair of them, got {value!r}")
    return int(pair[0]), int(pair[1])


def _padding(where: str, padding: str) -> str:
    if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
        raise ValueError(f"{where}: padding must be 'valid' or 'same', got {padding!r}")
    return padding.lower()


class Layer:
    """Base class: a name, weights made by `build(input_shape)` on the first call, and the
    input checks of Keras's InputSpec (rank, and the sizes the weights were built for).

    `dtype` (Keras's): a gd.nn.DTypePolicy, a policy name ("mixed_bfloat16") or a float
    dtype; None takes gd.config.precision() at construction. The layer makes its variables
    in `variable_dtype` and casts float inputs, and its weights as it reads them (`call`
    uses `self.in_compute_dtype(w)`), to `compute_dtype`: the cast's gradient brings the
    gradient back to the float32 master weight. With no `dtype` under the "float32"
    precision nothing is cast and the weights follow the input (float64 in, float64 weights).

    >>> layer = gd.nn.Dense(4, dtype="mixed_bfloat16"); layer.compute_dtype
    'bfloat16'
    """

    default_name = ""              # Keras's base name; else the class name in snake case
    rank: int | None = None        # the input rank the layer needs, if fixed
    min_rank = 0
    makes_weights = True           # does build() make variables (checkpoints need them)?

    def __init__(self, name: str | None = None, dtype=None):
        base = type(self).__dict__.get("default_name") or re.sub(
            r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()
        self.name = str(name) if name is not None else _unique_name(base)
        self.built = False
        self.dtype = np.dtype(np.float32)         # of the weights, set on the first call
        self._dtype_policy = dtype_policy(dtype)
        self._autocast = dtype is not None or self._dtype_policy.name != "float32"
        self.input_shape: tuple | None = None
        self._weights: dict[str, Variable] = {}
        self._fixed_axes: dict[int, int] = {}      # axis -> size the weights were built for

    def build(self, input_shape: tuple) -> None:
        pass

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__:
            cls.build = _marks_built(cls.__dict__["build"])

    # ------------------------------------------------------------ dtypes (Keras's names)
    dtype_policy = property(lambda self: self._dtype_policy)

    @property
    def compute_dtype(self) -> str:
        return self._dtype_policy.compute_dtype if self._autocast else self.dtype.name

    @property
    def variable_dtype(self) -> str:
        return self._dtype_policy.variable_dtype if self._autocast else self.dtype.name

    def in_compute_dtype(self, value):
        """`value` (an input or a weight read in `call`) in the compute dtype, if it is a float
        tensor of another dtype."""
        if not self._autocast:
            return value
        dtype = np.dtype(self.compute_dtype)
        have = _dtype(value)
        return cast(value, dtype) if is_float(have) and have != dtype else value

    def call(self, x, training: bool = False):
        raise NotImplementedError

    def add_weight(self, name: str, value, trainable: bool = True,
                   synchronization=VariableSynchronization.AUTO,
                   aggregation=VariableAggregation.NONE) -> Variable:
        v = Variable(value, name=f"{self.name}/{name}", trainable=trainable,
                     synchronization=synchronization, aggregation=aggregation)
        self._weights[name] = v
        return v

    def __call__(self, x, training=False):
        shape = _shape(x)
        self._check_input(shape)
        if not self.built:
            # float64 inputs get float64 weights; everything else float32 (Keras's default)
            self.dtype = np.dtype(self._dtype_policy.variable_dtype if self._autocast else
                                  np.float64 if _dtype(x) == np.float64 else np.float32)
            self._weights.clear()  # of a build that raised part-way
            self.build(shape)      # concrete values: variables made mid-trace, as slots are
            self.built, self.input_shape = True, shape
            self._check_input(shape)
        with name_scope(self.name):
            return self.call(self.in_compute_dtype(x), training=bool(training))

    def _check_input(self, shape: tuple) -> None:
        what = f"{type(self).__name__} '{self.name}'"
        if self.rank is not None and len(shape) != self.rank:
            raise ShapeError(f"{what}: expected a rank-{self.rank} input, got shape {shape}")
        if len(shape) < self.min_rank:
            raise ShapeError(f"{what}: expected an input of rank >= {self.min_rank}, got "
                             f"shape {shape}")
        for axis, size in self._fixed_axes.items():
            if shape[axis] != size:
                raise ShapeError(f"{what}: was built for inputs of shape {self.input_shape} "
                                 f"(axis {axis} of size {size}), got shape {shape}")

    # ------------------------------------------------------------ variables
    def _sublayers(self) -> list:
        out = []
        for value in vars(self).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            out += [e for e in items if isinstance(e, Layer)]
        return out

    @property
    def variables(self) -> list:
        seen, out = set(), []
        for v in itertools.chain(self._weights.values(),
                                 *(s.variables for s in self._sublayers())):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    @property
    def trainable_variables(self) -> list:
        return [v for v in self.variables if v.trainable]

    @property
    def non_trainable_variables(self) -> list:
        return [v for v in self.variables if not v.trainable]

    def _checkpoint_children(self):
        """What gd.Checkpoint saves under this layer: weights by their short name, sublayers
        by the attribute holding them (so another instance, named dense_7, restores too)."""
        if not self.built and self.makes_weights and type(self).build is not Layer.build:
            raise CheckpointError(f"{type(self).__name__} '{self.name}' has no variables yet "
                                  "(a layer makes them on its first call): call the model once, "
                                  "on a batch, before saving or restoring a checkpoint")
        children = list(self._weights.items())
        for key, value in vars(self).items():
            items = value if isinstance(value, (list, tuple)) else [value]
            if items and all(isinstance(e, Layer) for e in items):
                children.append((key, value))
        return children

    def __repr__(self) -> str:
        return f"<gd.nn.{type(self).__name__} '{self.name}'>"


def _marks_built(build):
    """A layer's `build` that leaves the layer built, as Keras's does: a user's
    `layer.build(input_shape)` (then assigns to its variables) makes the weights its first
    call uses, where the call would otherwise have made new ones and dropped those."""
    @functools.wraps(build)
    def build_and_mark(self, input_shape):
        if not self.built and self._autocast:       # the call sets it first; a user has not
            self.dtype = np.dtype(self._dtype_policy.variable_dtype)
        build(self, input_shape)
        self.built, self.input_shape = True, tuple(input_shape)
    return build_and_mark


class Dense(Layer):
    """activation(x @ kernel + bias) over the last axis.

    >>> layer = gd.nn.Dense(10, activation="relu"); y = layer(np.ones((4, 3), np.float32))
    """

    default_name = "dense"
    min_rank = 2

    def __init__(self, units: int, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", name=None,
                 dtype=None):
        super().__init__(name, dtype)
        self.units = int(units)
        self.activation = _activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer

    def build(self, input_shape):
        shape = (input_shape[-1], self.units)
        self.kernel = self.add_weight("kernel", _initial(self.kernel_initializer, shape,
                                                         self.dtype))
        if self.use_bias:
            self.bias = self.add_weight("bias", _initial(self.bias_initializer, (self.units,),
                                                         self.dtype))
        self._fixed_axes = {-1: input_shape[-1]}

    def call(self, x, training=False):
        shape = _shape(x)
        y = matmul(x if len(shape) == 2 else reshape(x, (-1, shape[-1])),
                   self.in_compute_dtype(self.kernel))
        if len(shape) != 2:
            y = reshape(y, shape[:-1] + (self.units,))
        if self.use_bias:
            y = add(y, self.in_compute_dtype(self.bias))
        return self.activation(y) if self.activation else y


class Conv2D(Layer):
    """2-D convolution of NHWC inputs with an (kh, kw, in, filters) kernel, plus bias.

    >>> layer = gd.nn.Conv2D(8, 3, padding="same"); y = layer(np.ones((2, 5, 5, 1), np.float32))
    """

    default_name = "conv2d"
    rank = 4

    def __init__(self, filters: int, kernel_size, strides=1, padding: str = "valid",
                 activation=None, use_bias: bool = True, dilation_rate=1,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", name=None,
                 dtype=None):
        super().__init__(name, dtype)
        self.filters = int(filters)
        self.kernel_size = _pair(f"Conv2D '{self.name}': kernel_size", kernel_size)
        self.strides = _pair(f"Conv2D '{self.name}': strides", strides)
        self.dilation_rate = _pair(f"Conv2D '{self.name}': dilation_rate", dilation_rate)
        self.padding = _padding(f"Conv2D '{self.name}'", padding)
        self.activation = _activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer

    def build(self, input_shape):
        shape = self.kernel_size + (input_shape[-1], self.filters)
        self.kernel = self.add_weight("kernel", _initial(self.kernel_initializer, shape,
                                                         self.dtype))
        if self.use_bias:
            self.bias = self.add_weight("bias", _initial(self.bias_initializer, (self.filters,),
                                                         self.dtype))
        self._fixed_axes = {-1: input_shape[-1]}

    def call(self, x, training=False):
        y = conv2d(x, self.in_compute_dtype(self.kernel), strides=self.strides,
                   padding=self.padding.upper(), dilations=self.dilation_rate)
        if self.use_bias:
            y = add(y, self.in_compute_dtype(self.bias))
        return self.activation(y) if self.activation else y


class MaxPool2D(Layer):
    """Max pooling of NHWC inputs; `strides` defaults to `pool_size`, as in Keras.

    >>> y = gd.nn.MaxPool2D()(np.ones((1, 4, 4, 3), np.float32))     # (1, 2, 2, 3)
    """

    default_name = "max_pooling2d"
    rank = 4
    _op = staticmethod(max_pool2d)

    def __init__(self, pool_size=2, strides=None, padding: str = "valid", name=None,
                 dtype=None):
        super().__init__(name, dtype)
        kind = type(self).__name__
        self.pool_size = _pair(f"{kind} '{self.name}': pool_size", pool_size)
        self.strides = _pair(f"{kind} '{self.name}': strides",
                             self.pool_size if strides is None else strides)
        self.padding = _padding(f"{kind} '{self.name}'", padding)

    def call(self, x, training=False):
        return self._op(x, self.pool_size, self.strides, self.padding.upper())


class AvgPool2D(MaxPool2D):
    """Average pooling of NHWC inputs; `strides` defaults to `pool_size`, as in Keras."""

    default_name = "average_pooling2d"
    _op = staticmethod(avg_pool2d)


class Flatten(Layer):
    """(batch, ...) -> (batch, prod(...)).

    >>> gd.nn.Flatten()(np.ones((2, 3, 4), np.float32)).shape
    (2, 12)
    """

    default_name = "flatten"
    min_rank = 1

    def call(self, x, training=False):
        shape = _shape(x)
        return reshape(x, (shape[0], int(np.prod(shape[1:], dtype=np.int64))))


class Dropout(Layer):
    """In training, zero each element with probability `rate` and scale the rest by
    1/(1-rate); the identity in inference. Each replica draws its own stream (a
    gd.random.Generator made on the first call, under the current strategy).

    >>> layer = gd.nn.Dropout(0.5, seed=1); y = layer(np.ones((2, 3), np.float32), training=True)
    """

    default_name = "dropout"
    makes_weights = False          # only its generator, which checkpoints leave out

    def __init__(self, rate: float, seed=None, name=None, dtype=None):
        super().__init__(name, dtype)
        self.rate = float(rate)
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"Dropout '{self.name}': rate must be in [0, 1), got {rate}")
        self.seed = seed
        self.generator = None

    def build(self, input_shape):
        if self.rate > 0:           # seed None: fresh entropy, as Keras
            self.generator = Generator(self.seed, name=f"{self.name}/generator")

    def call(self, x, training=False):
        if not training or self.rate == 0:
            return x
        return dropout(x, self.rate, generator=self.generator)


__all__ = ["AvgPool2D", "Conv2D", "Dense", "Dropout", "Flatten", "Layer", "MaxPool2D"]
