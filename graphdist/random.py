"""gd.random: counter-based random numbers (Philox) whose state is a variable, as TF's
tf.random.Generator, and gd.nn.dropout built on them. The op that draws is
graphdist/ops/random.py; initializers are graphdist/initializers.py.

A Generator's state is an int64[3] variable (counter, 128-bit key) made under the current
strategy's scope: mirrored, so every replica holds the same counter. Each draw reads the
state, draws from the Philox stream of (key folded with the replica id, counter), and
assigns counter + 1: inside a compiled step the advance is an ordinary variable update,
written with the step's other state at the end of its program (24 bytes: never computed
into storage early, runtime/lower.py), so a step that fails leaves the counter as it was and
its rerun draws the same numbers.
"""

from __future__ import annotations

import numbers
import weakref

import numpy as np

from graphdist.distribute.context import get_replica_context, get_strategy
from graphdist.errors import TraceError
from graphdist.ir.types import as_dtype, is_float
from graphdist.ops import random as ops
from graphdist.ops.core import Symbolic, current_tracer
from graphdist.ops.math import add, divide, greater_equal, multiply, where
from graphdist.variables import Variable

_ADVANCE = np.array([1, 0, 0], np.int64)      # one counter step per draw (see ops/random.py)


def _key(seed) -> np.ndarray:
    """128 bits of key (as two int64 words) from an int or a sequence of ints; None: fresh
    entropy from the OS."""
    if seed is None:
        seq = np.random.SeedSequence()
    else:
        words = [seed] if isinstance(seed, numbers.Integral) else list(np.ravel(seed))
        if not words or not all(isinstance(w, numbers.Integral) for w in words):
            raise TypeError(f"a random seed is an int or a sequence of ints, got {seed!r}")
        seq = np.random.SeedSequence([int(w) & (2**64 - 1) for w in words])
    return seq.generate_state(2, np.uint64).view(np.int64)


def _float_dtype(method: str, dtype) -> np.dtype:
    dtype = as_dtype(dtype)
    if not is_float(dtype):
        raise TypeError(f"{method}: dtype must be a float dtype, got {dtype}")
    return dtype


def _replica_id():
    """This replica's id where the code runs per replica; 0 in cross-replica context, which
    draws the generator's own stream (TF mixes the replica id in replica context only)."""
    ctx = get_replica_context()
    return 0 if ctx is None else ctx.replica_id_in_sync_group


class Generator:
    """Counter-based random numbers with the state in a variable (TF's tf.random.Generator).

    Made under `strategy.scope()` its state is mirrored; inside `strategy.run` each replica
    draws from its own stream (the key folded with the replica id), reproducible for a seed
    and replica count. Eagerly a draw returns numpy; in traced code it is an op, and the
    state's advance is part of the step.

    >>> g = gd.random.Generator(seed=1); g.uniform((2,)).shape
    (2,)
    """

    def __init__(self, seed=None, name: str = "generator"):
        state = np.concatenate([[0], _key(seed)]).astype(np.int64)
        self.state = Variable(state, name=f"{name}/state", trainable=False)

    @classmethod
    def from_seed(cls, seed, name: str = "generator") -> Generator:
        return cls(seed, name=name)

    @classmethod
    def from_non_deterministic_state(cls, name: str = "generator") -> Generator:
        return cls(None, name=name)

    key = property(lambda self: self.state.numpy()[1:].view(np.uint64),
                   doc="the 128-bit Philox key (two uint64 words)")
    counter = property(lambda self: int(self.state.numpy()[0]),
                       doc="how many draws this generator has made")

    def reset_from_seed(self, seed) -> None:
        """Start again from `seed`, as a new Generator(seed) would (eagerly)."""
        self.state.assign(np.concatenate([[0], _key(seed)]).astype(np.int64))

    # ------------------------------------------------------------ distributions
    def uniform(self, shape, minval=0, maxval=1, dtype="float32"):
        """Uniform numbers in [minval, maxval)."""
        u = self._draw("uniform", shape, _float_dtype("Generator.uniform", dtype))
        if _is(minval, 0) and _is(maxval, 1):
            return u
        return add(multiply(u, maxval - minval), minval)

    def normal(self, shape, mean=0.0, stddev=1.0, dtype="float32"):
        """Normal numbers of the given mean and standard deviation."""
        return _affine(self._draw("normal", shape, _float_dtype("Generator.normal", dtype)),
                       mean, stddev)

    def truncated_normal(self, shape, mean=0.0, stddev=1.0, dtype="float32"):
        """Normal numbers, those beyond 2 standard deviations drawn again (TF's rule)."""
        dtype = _float_dtype("Generator.truncated_normal", dtype)
        return _affine(self._draw("truncated_normal", shape, dtype), mean, stddev)

    # ------------------------------------------------------------ drawing
    def _draw(self, dist: str, shape, dtype):
        if current_tracer() is None:
            return self.draw_now(dist, shape, dtype)
        state = self.state.read_value()      # this replica's component (all equal)
        out = ops.philox_random(state, _replica_id(), dist, _shape(shape), dtype)
        self.state.assign_synced(add(state, _ADVANCE))   # every replica computes the same
        return out

    def draw_now(self, dist: str, shape, dtype="float32") -> np.ndarray:
        """Numbers now, as numpy, even inside a trace (initial values of variables made
        while tracing), from the generator's own stream; the state advances now."""
        tracer = current_tracer()
        if tracer is not None and self.state in tracer.state_in:
            raise TraceError(f"generator '{self.state.name}' is used by the step being traced "
                             "and cannot also draw eagerly inside it (an initializer, say); "
                             "give the initializer its own generator or a seed")
        state = self.state.numpy()
        out = ops.draw(state, 0, dist, _shape(shape), as_dtype(dtype))
        self.state.assign_components(self.state.components_for(state + _ADVANCE))
        return out

    def _checkpoint_children(self):
        return [("state", self.state)]    # gd.Checkpoint saves and restores the state

    def __repr__(self) -> str:
        return f"<gd.random.Generator '{self.state.name}' counter={self.counter}>"


def _is(x, number) -> bool:
    return isinstance(x, numbers.Number) and x == number


def _shape(shape) -> tuple:
    return (int(shape),) if isinstance(shape, numbers.Integral) else tuple(int(d) for d in shape)


def _affine(x, mean, stddev):
    if not _is(stddev, 1):
        x = multiply(x, stddev)
    return x if _is(mean, 0) else add(x, mean)


# ---------------------------------------------------------------- global generators

_global: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_global_generator() -> Generator:
    """The current strategy's global generator (made on first use, non-deterministically
    seeded unless set_global_generator replaced it)."""
    strategy = get_strategy()
    gen = _global.get(strategy)
    if gen is None:
        with strategy.scope():
            gen = _global[strategy] = Generator(None, name="global_generator")
    return gen


def set_global_generator(generator: Generator) -> None:
    """Make `generator` the global one of the strategy whose scope it was made in (only for
    code traced after this call: compiled steps keep the generator they captured)."""
    _global[generator.state._strategy] = generator


def draw_now(dist: str, shape, dtype="float32", seed=None, generator=None) -> np.ndarray:
    """Numbers now, as numpy (initializers): from `seed` (stateless: the same numbers for
    the same seed), from `generator` (advancing it), or from the global generator."""
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both")
    if seed is not None:
        state = np.concatenate([[0], _key(seed)]).astype(np.int64)
        return ops.draw(state, 0, dist, _shape(shape), as_dtype(dtype))
    return (generator or get_global_generator()).draw_now(dist, shape, dtype)


# ---------------------------------------------------------------- dropout

def dropout(x, rate, noise_shape=None, seed=None, generator=None):
    """Zero each element with probability `rate`, scale the others by 1/(1-rate) (TF).

    `generator`: a gd.random.Generator, advanced by each call (a fresh mask every step).
    `seed`: stateless, the same mask for the same seed and shape on every call (TF's
    stateless_dropout); neither: the strategy's global generator. Under a strategy each
    replica draws its own mask. `noise_shape` broadcasts to x's shape (None entries: x's).

    >>> gd.nn.dropout(np.ones(4, np.float32), 0.5, seed=1)      # doctest: +SKIP
    array([2., 0., 2., 2.], dtype=float32)
    """
    if isinstance(rate, Symbolic) or not isinstance(rate, numbers.Real) \
            or not 0 <= float(rate) < 1:
        raise ValueError(f"dropout: rate must be a number in [0, 1), got {rate!r}")
    if seed is not None and generator is not None:
        raise ValueError("dropout: pass seed or generator, not both")
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if not is_float(dtype):
        raise TypeError(f"dropout: x must be a float tensor, got {dtype}")
    if float(rate) == 0:
        return x
    shape = tuple(getattr(x, "shape", np.shape(x)))
    noise = _noise_shape(shape, noise_shape)
    if generator is None and seed is None:
        generator = get_global_generator()
    if generator is not None:
        u = generator.uniform(noise, dtype="float32")
    else:
        state = np.concatenate([[0], _key(seed)]).astype(np.int64)
        u = ops.philox_random(state, _replica_id(), "uniform", noise, "float32")
    keep = greater_equal(u, np.float32(rate))                # P(keep) = 1 - rate
    scaled = divide(x, np.asarray(1 - float(rate), dtype))   # exactly x / (1 - rate)
    return where(keep, scaled, np.zeros((), dtype))


def _noise_shape(shape: tuple, noise_shape) -> tuple:
    if noise_shape is None:
        return shape
    noise = tuple(noise_shape)
    if len(noise) == len(shape):
        noise = tuple(s if n is None else int(n) for n, s in zip(noise, shape))
    if len(noise) != len(shape) or any(n not in (1, s) for n, s in zip(noise, shape)):
        raise ValueError(f"dropout: noise_shape {tuple(noise_shape)} does not broadcast to "
                         f"x's shape {shape} (same rank; each entry 1, None or x's size)")
    return noise


__all__ = ["Generator", "draw_now", "dropout", "get_global_generator", "set_global_generator"]
