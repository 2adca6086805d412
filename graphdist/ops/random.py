"""philox_random: counter-based random numbers (numpy's Philox4x64), a pure function of a
generator state (counter, key) and the replica id. The state variable and its advance live
in graphdist/random.py (gd.random.Generator); this op only describes one draw."""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType, as_dtype, is_float
from graphdist.ops.core import Op, Symbolic, bind

DISTRIBUTIONS = ("uniform", "normal", "truncated_normal")
STATE_TYPE = ArrayType((3,), np.dtype("int64"))   # (counter, key word 0, key word 1)

# Pure: the same (state, replica id) gives the same numbers, so a draw may be deduplicated
# or dropped like any op; what makes draws differ is that each one reads a new state version.
random_p = Op("philox_random", differentiable=False)


@random_p.def_shape
def _random_shape(state, rid, *, dist, shape, dtype):
    if state != STATE_TYPE or rid != ArrayType((), np.dtype("int32")):
        raise ShapeError(f"philox_random: expected a state {STATE_TYPE} and a replica id "
                         f"i32[], got {state} and {rid}")
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"philox_random: dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    if not is_float(dtype):
        raise TypeError(f"philox_random: {dist} draws floats, got dtype {dtype}")
    return ArrayType(shape, dtype)


def stream_key(key, rid: int) -> np.ndarray:
    """The Philox key of replica `rid`'s stream: the generator's own key for replica 0 (so a
    one-replica strategy draws what no strategy draws), else a hash of (key, rid): Philox
    output at counter (0, 0, 0, rid), a part of the key's counter space no draw reaches
    (draws use word 2 for the draw index and never carry into word 3)."""
    key = np.asarray(key).astype(np.int64).view(np.uint64)     # two words, bits as they are
    if rid == 0:
        return key
    counter = np.array([0, 0, 0, rid], np.uint64)
    return np.random.Philox(key=key, counter=counter).random_raw(2)


def draw(state, rid: int, dist: str, shape, dtype) -> np.ndarray:
    """One draw on the host: a Philox stream keyed by (key, rid), starting at counter
    (0, 0, counter, 0). Each draw owns 2**128 Philox blocks, so however many numbers a
    distribution consumes (normal and truncated normal reject), draws never overlap."""
    state = np.asarray(state, np.int64)
    counter = np.array([0, 0, state[0], 0], np.int64).view(np.uint64)
    rng = np.random.Generator(np.random.Philox(key=stream_key(state[1:], rid), counter=counter))
    work = np.float64 if dtype == np.float64 else np.float32   # narrower floats: cast after
    if dist == "uniform":
        out = np.asarray(rng.random(shape, dtype=work))      # [0, 1)
    else:
        out = np.asarray(rng.standard_normal(shape, dtype=work))
        if dist == "truncated_normal":                       # TF: resample beyond 2 stddev
            bad = np.abs(out) > 2
            while bad.any():
                out[bad] = rng.standard_normal(int(bad.sum()), dtype=work)
                bad = np.abs(out) > 2
    return out.astype(dtype, copy=False)


@random_p.def_impl
def _random_impl(xp, state, rid, *, dist, shape, dtype):
    # Computed on the host and copied to the device (CuPy): the stream must be numpy's
    # Philox bit for bit, and the state is 24 bytes; a device kernel would be an optimization.
    host = (lambda a: a) if xp is np else xp.asnumpy
    return xp.asarray(draw(host(state), int(host(rid)), dist, shape, dtype))


random_p.def_cost(lambda ins, outs, **_: (20 * outs[0].size, outs[0].nbytes))


def philox_random(state, rid, dist: str, shape, dtype="float32"):
    """`shape` numbers of `dist` ("uniform" in [0, 1), "normal", "truncated_normal" within
    2) for generator state `state` (int64[3]: counter, key) and replica id `rid`.

    >>> philox_random(np.array([0, 1, 2]), np.int32(0), "uniform", (2,)).shape
    (2,)
    """
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ShapeError(f"philox_random: negative dimension in shape {shape}")
    if not isinstance(state, Symbolic):
        state = np.asarray(state, np.int64)
    if isinstance(rid, (int, np.integer)):
        rid = np.int32(rid)
    return bind(random_p, state, rid, dist=dist, shape=shape, dtype=as_dtype(dtype))
