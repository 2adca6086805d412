"""Fused elementwise kernels: one generated Numba loop per cluster of elementwise ops
(graphdist/passes/fuse_elementwise.py), so a chain such as `relu_grad(ct * s + r, y)`
reads each input once and writes each result once instead of making a pass over memory per
op.

FORMULAS is the table of the member ops the generator knows: op name -> a function of
(argument expressions, params, output dtype name) giving the scalar expression that op
computes, or None where it cannot (a dtype or param its formula does not cover). Every
formula gives the bits of the op's own CPU form (numpy's ufunc, or the op's Numba kernel:
gelu and its gradient in float32 run kernels/gelu.py's rational erf and tanh here too), with
fastmath off: no reassociation, no fused multiply-add, so the fused loop computes the same
float operations in the same order as the ops one after another. Transcendental functions
(exp, log, tanh, sigmoid, pow) have no entry: numpy's SIMD versions and the C library's
differ in the last bit, so a fused loop could not give the unfused program's bits.

`kernel_source(steps, kinds, ...)` writes a cluster's loop as Python source;
`compiled(source)` compiles it once per process (Numba's on-disk cache keeps it across
processes: the source is written to a file named after its hash); `run(...)` calls it.
Importing this module imports neither Numba nor graphdist: the pass reads FORMULAS.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading


FLOATS = ("float32", "float64")

# how an input of a cluster is read: every element (the output's shape), one row per
# `cols` elements (a bias row broadcast along the leading axes), one value per row of the
# output's last axis (a column of statistics, shape (..., m, 1) against (..., m, n)), or one
# value
FULL, ROW, COL, SCALAR = "full", "row", "col", "scalar"


def _binary(fmt: str):
    return lambda a, params, dtype: fmt.format(*a)


def _maximum(a, params, dtype):
    # numpy's maximum: NaN from either side, and the second operand when they compare equal
    # (maximum(-0.0, 0.0) is 0.0, maximum(0.0, -0.0) is -0.0)
    return f"({a[0]} if ({a[0]} > {a[1]} or {a[0]} != {a[0]}) else {a[1]})"


def _minimum(a, params, dtype):
    return f"({a[0]} if ({a[0]} < {a[1]} or {a[0]} != {a[0]}) else {a[1]})"


def _relu(a, params, dtype):
    return _maximum([a[0], f"np.{dtype}(0)"], params, dtype)


def _clip(a, params, dtype):
    # the op's order (TF's): min(t, hi) first, then max(., lo)
    return _maximum([_minimum([a[0], a[2]], params, dtype), a[1]], params, dtype)


def _cast(a, params, dtype):
    return f"np.{dtype}({a[0]})" if dtype in FLOATS else None


def _gelu(a, params, dtype):
    form = "tanh" if params["approximate"] else "erf"
    if dtype == "float32":
        return f"_gelu_{form}32({a[0]})"
    return f"_gelu1(np.float64({a[0]}), {bool(params['approximate'])})[0]"


def _gelu_grad(a, params, dtype):
    form = "tanh" if params["approximate"] else "erf"
    if dtype == "float32":
        return f"_gelu_{form}_grad32({a[0]}, {a[1]})"
    return f"({a[0]} * _gelu1(np.float64({a[1]}), {bool(params['approximate'])})[1])"


FORMULAS = {
    "add": _binary("({} + {})"),
    "sub": _binary("({} - {})"),
    "mul": _binary("({} * {})"),
    "div": _binary("({} / {})"),
    "neg": lambda a, params, dtype: f"(-{a[0]})",
    "abs": lambda a, params, dtype: f"abs({a[0]})",
    "square": lambda a, params, dtype: f"({a[0]} * {a[0]})",
    "sqrt": lambda a, params, dtype: f"math.sqrt({a[0]})",
    "maximum": _maximum,
    "minimum": _minimum,
    "relu": _relu,
    "relu_grad": lambda a, params, dtype: f"({a[0]} if {a[1]} > 0 else np.{dtype}(0))",
    "where": lambda a, params, dtype: f"({a[1]} if {a[0]} else {a[2]})",
    "clip_by_value": _clip,
    "cast": _cast,
    "gelu": _gelu,
    "gelu_grad": _gelu_grad,
    "greater": _binary("({} > {})"),
    "greater_equal": _binary("({} >= {})"),
    "less": _binary("({} < {})"),
    "less_equal": _binary("({} <= {})"),
    "equal": _binary("({} == {})"),
    "not_equal": _binary("({} != {})"),
    "logical_and": _binary("({} and {})"),
    "logical_or": _binary("({} or {})"),
    "logical_not": lambda a, params, dtype: f"(not {a[0]})",
}


def formula(op: str, args: list, params: dict, dtype: str) -> str | None:
    """The scalar expression of op on `args` (expressions) giving a `dtype` value, or None
    where the table has none."""
    make = FORMULAS.get(op)
    return None if make is None else make(args, params, dtype)


# the generated file's first lines: what its loops call. The gelu forms are
# kernels/gelu.py's loop bodies, in their order of operations, so they give those bits
PRELUDE = '''\
import math

import numpy as np
from numba import njit, prange

from graphdist.kernels.gelu import (_C3K_32, _C_32, _CK_32, _HALF, _ONE, _RSQRT2_32,
                                    _RSQRT2PI_32, _SLOPE_X2_MAX, _erf32,
                                    _exp_nonpositive32, _gelu1, _tanh32)


@njit(cache=True, inline="always")
def _gelu_erf32(v):
    return v * _HALF * (_ONE + _erf32(v * _RSQRT2_32))


@njit(cache=True, inline="always")
def _gelu_erf_grad32(ct, v):
    cdf = _HALF * (_ONE + _erf32(v * _RSQRT2_32))
    return ct * (cdf + v * _exp_nonpositive32(-_HALF * v * v) * _RSQRT2PI_32)


@njit(cache=True, inline="always")
def _gelu_tanh32(v):
    t = _tanh32((v * v * _CK_32 + _C_32) * v)
    return v * _HALF * (t + _ONE)


@njit(cache=True, inline="always")
def _gelu_tanh_grad32(ct, v):
    v2 = v * v
    t = _tanh32((v2 * _CK_32 + _C_32) * v)
    slope = (_ONE - t * t) * (v * _HALF) * (min(v2, _SLOPE_X2_MAX) * _C3K_32 + _C_32)
    return ct * ((t + _ONE) * _HALF + slope)

'''


def kernel_source(steps, kinds, num_literals: int, outputs, dtypes) -> str:
    """The source of one cluster's kernel `kernel(rows, cols, x0.., k0.., o0..)`.

    steps:    (op name, params dict, argument refs, result ref) per member, in order; a ref
              is ("x", j) for input j, ("k", j) for literal j, ("t", j) for member j's result
    kinds:    FULL, ROW, COL or SCALAR for each input (flat arrays; ROW ones hold `cols`
              values, COL ones `rows`)
    outputs:  the member results the kernel writes, one output array each
    dtypes:   the dtype name of each member's result

    Raises KeyError for an op FORMULAS does not know (the pass asked it first)."""
    xs = [f"x{j}" for j in range(len(kinds))]
    ks = [f"k{j}" for j in range(num_literals)]
    os_ = [f"o{j}" for j in range(len(outputs))]
    rows = ROW in kinds or COL in kinds
    lines = [f"@njit(parallel=True, fastmath=False, error_model='numpy', cache=True)",
             f"def kernel(rows, cols, {', '.join(xs + ks + os_)}):"]
    lines += [f"    s{j} = x{j}[0]" for j, kind in enumerate(kinds) if kind == SCALAR]
    names = {}
    if rows:
        # each row's slices, indexed by the column: an index computed as r * cols + c kept
        # LLVM from vectorizing the loop (10x slower than numpy's passes)
        full = [f"x{j}" for j, kind in enumerate(kinds) if kind == FULL] + os_
        lines += ["    for r in prange(rows):", "        lo = r * cols",
                  *(f"        {a}r = {a}[lo:lo + cols]" for a in full),
                  *(f"        c{j} = x{j}[r]" for j, kind in enumerate(kinds) if kind == COL),
                  "        for i in range(cols):"]
        pad = " " * 12
        os_ = [f"{o}r" for o in os_]
    else:
        lines += ["    for i in prange(rows * cols):"]
        pad = " " * 8
    for j, kind in enumerate(kinds):
        names[("x", j)] = {FULL: f"x{j}r[i]" if rows else f"x{j}[i]", ROW: f"x{j}[i]",
                           COL: f"c{j}", SCALAR: f"s{j}"}[kind]
    names.update((("k", j), f"k{j}") for j in range(num_literals))
    for j, (op, params, args, result) in enumerate(steps):
        dtype = dtypes[j]
        expr = formula(op, [names[a] for a in args], params, dtype)
        if expr is None:
            raise KeyError(f"fused_elementwise: no formula for {op} giving {dtype}")
        typed = f"np.{dtype}({expr})" if dtype in FLOATS else expr
        lines.append(f"{pad}t{j} = {typed}")
        names[result] = f"t{j}"
    lines += [f"{pad}{o}[i] = {names[ref]}" for o, ref in zip(os_, outputs)]
    return f"# {_callee_version()}\n" + PRELUDE + "\n".join(lines) + "\n"


_versions: list = []


def _callee_version() -> str:
    """A hash of the kernel modules the generated loops call (gelu.py and its constants in
    gelu_numpy.py): part of each source, so a change there makes new files, never a stale
    cached loop (Numba's cache checks a file's own timestamp, not its callees')."""
    if not _versions:
        here = os.path.dirname(os.path.abspath(__file__))
        digest = hashlib.sha1()
        for name in ("gelu.py", "gelu_numpy.py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(f.read())
        _versions.append(f"callees {digest.hexdigest()[:16]}")
    return _versions[0]


_compiled: dict = {}
_lock = threading.Lock()


def _cache_dir() -> str:
    path = os.environ.get("GRAPHDIST_FUSED_DIR") or os.path.join(
        tempfile.gettempdir(), f"graphdist-fused-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(path, exist_ok=True)
    return path


def compiled(source: str):
    """The kernel of `source`, compiled on its first call (Numba compiles per operand types
    when first called; its on-disk cache keeps each specialization). The source lives in a
    file named after its hash, written once, so the cache finds it again in a new process."""
    fn = _compiled.get(source)
    if fn is not None:
        return fn
    with _lock:
        fn = _compiled.get(source)
        if fn is None:
            name = "fused_" + hashlib.sha1(source.encode()).hexdigest()[:20]
            try:
                module = _module_from_file(name, source)
                kernel = module.kernel
            except OSError:                   # no writable cache folder: compile in memory
                kernel = _exec_kernel(name, source)
            fn = _compiled[source] = kernel
    return fn


def _module_from_file(name: str, source: str):
    """The module of `source`, imported from its file in the cache folder (written first
    when it is not there yet), so Numba's on-disk cache applies to it."""
    path = os.path.join(_cache_dir(), name + ".py")
    if not os.path.exists(path):          # rewritten, its mtime would void the cache
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module            # where Numba's cache looks its globals up
    spec.loader.exec_module(module)
    return module


def _exec_kernel(name: str, source: str):
    """`source`'s kernel compiled from memory, without Numba's cache (it needs a file)."""
    namespace: dict = {}
    exec(compile(source.replace("cache=True", "cache=False"), f"<{name}>", "exec"), namespace)
    return namespace["kernel"]


# bytes touched from which a loop of cheap members runs on every thread: below it one
# thread nearly fills this 2-core VM's memory bandwidth (x * s + mask, 2 and 4 MiB out:
# 40-50 and 79-104 us on one thread, 49-58 and 87-109 us on two; numpy's two passes 92-96
# and 173-214 us; from 8 MiB out two threads won or tied: 130-175 against 165-207 us).
# Loops with gelu members are bound by their arithmetic: kernels/common.py's threshold.
CHEAP_PARALLEL_MIN_BYTES = 16 << 20


def run(source: str, kinds, cols: int, inputs, literals, outs) -> None:
    """Run `source`'s kernel: `inputs` flat arrays as `kinds` says, `literals` numpy
    scalars, `outs` flat C-contiguous output arrays of rows * cols elements."""
    from .common import PARALLEL_MIN_BYTES, threads_for

    n = outs[0].size
    rows = n // cols if cols else 0
    nbytes = sum(x.nbytes for x in inputs) + sum(o.nbytes for o in outs)
    heavy = "_gelu" in source.rpartition("def kernel(")[2]     # the loop, not the prelude
    if not heavy:      # threads_for's threshold scaled to the cheap loops' own
        nbytes = nbytes * PARALLEL_MIN_BYTES // CHEAP_PARALLEL_MIN_BYTES
    with threads_for(nbytes):
        compiled(source)(rows, cols, *inputs, *literals, *outs)
