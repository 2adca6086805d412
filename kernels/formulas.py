"""The optimizer updates, each written once, and the hyper-parameter vector they read.

Every path computes an update from these functions:

- the update ops' functional impls (graphdist/ops/optim.py) and the `*_ref` specs call them
  on whole arrays (numpy or CuPy: plain arithmetic and numpy's `sqrt`, which dispatches);
- the Numba CPU and CUDA kernels (sgd.py, adam.py, reduce_update.py) compile them, as
  `scalar_form` gives them, as scalar functions called from their loops;
- the in-place numpy forms (graphdist/runtime/numpy_updates.py) run them through
  `chunk_program`, which traces the formula once per branch taken and replays its ufuncs
  with `out=` into the variables' own chunks and two scratch chunks: no temporaries.

So all of them do the same float operations in the same order and give the same bits. A
formula is elementwise arithmetic on its array operands and the scalars it is given, already
rounded to the arrays' dtype (`sgd_scalars`, `adam_scalars`): it may compare a scalar with a
number to pick a branch, but computes nothing from scalars alone (a kernel would redo that
per element; the scalars functions do it once).

The hyper-parameter vector (float64, an input of each update op, made on the device by the
optimizer) is laid out by the fields of `SGDHyper`, `MomentumHyper` and `AdamHyper`; it is
built only through their `encode` and read only through `decode` (named, on the host) or the
scalars functions (rounded, also inside CUDA kernels). Imports numpy only: no numba, so the
ops import it without compiling anything.
"""

from __future__ import annotations

import math
import types
from typing import Any, NamedTuple

import numpy as np
from numpy import sqrt     # the formulas' square root: scalar_form swaps in math.sqrt

# ---------------------------------------------------------------- the hyper-parameter vector


class SGDHyper(NamedTuple):
    """sgd_update's and sparse_sgd_update's vector: p' = p - lr * (g + weight_decay * p)."""

    lr: Any
    weight_decay: Any

    def encode(self) -> tuple:
        """The vector's entries, in order (numbers or float64 scalar tensors)."""
        return tuple(self)

    @classmethod
    def decode(cls, hyper) -> SGDHyper:
        """Named Python floats from a host vector (reads a device vector back: a sync)."""
        return cls(*_host_values(cls, hyper, (2,)))


class MomentumHyper(NamedTuple):
    """sgd_momentum_update's vector; momentum 0 is plain SGD and leaves the buffer as is."""

    lr: Any
    momentum: Any
    weight_decay: Any

    def encode(self) -> tuple:
        return tuple(self)

    @classmethod
    def decode(cls, hyper) -> MomentumHyper:
        return cls(*_host_values(cls, hyper, (3,)))


class AdamHyper(NamedTuple):
    """adam_update's vector. lr_t is the bias-corrected rate lr * sqrt(1 - beta_2^t) /
    (1 - beta_1^t); weight_decay_lr (lr * weight_decay) makes it AdamW, and None leaves it
    out of the vector (Adam's 4 entries against AdamW's 5)."""

    lr_t: Any
    beta_1: Any
    beta_2: Any
    epsilon: Any
    weight_decay_lr: Any = None

    def encode(self) -> tuple:
        return tuple(self) if self.weight_decay_lr is not None else tuple(self)[:4]

    @classmethod
    def decode(cls, hyper) -> AdamHyper:
        return cls(*_host_values(cls, hyper, (4, 5)))


def _host_values(cls, hyper, sizes: tuple) -> list:
    values = hyper.tolist() if hasattr(hyper, "tolist") else [float(x) for x in hyper]
    if len(values) not in sizes:
        want = " or ".join(map(str, sizes))
        raise ValueError(f"{cls.__name__}: expected {want} hyper-parameters "
                         f"({', '.join(cls._fields)}), got {len(values)}")
    return values


# The formulas' scalars, rounded to the dtype of `like` (an array of the update) as numpy
# rounds a Python float against an array (NEP 50). `hyper` is indexed by the fields above:
# a host list (SGDHyper(...).encode(), hyper.tolist()) or, inside a CUDA kernel, the device
# vector itself, so each kernel thread rounds the float64 entries as the host does (cvt.rn).

def sgd_scalars(hyper, like):
    """(lr, momentum, weight_decay) from an SGDHyper (momentum 0) or MomentumHyper vector."""
    dt = like.dtype.type
    if len(hyper) == 3:
        return dt(hyper[0]), dt(hyper[1]), dt(hyper[2])
    return dt(hyper[0]), dt(0.0), dt(hyper[1])


def adam_scalars(hyper, like):
    """(lr_t, beta_1, 1 - beta_1, beta_2, 1 - beta_2, epsilon, weight_decay_lr) from an
    AdamHyper vector; 1 - beta is taken in float64, then rounded."""
    dt = like.dtype.type
    beta_1, beta_2 = hyper[1], hyper[2]
    weight_decay_lr = hyper[4] if len(hyper) > 4 else 0.0
    return (dt(hyper[0]), dt(beta_1), dt(1.0 - beta_1), dt(beta_2), dt(1.0 - beta_2),
            dt(hyper[3]), dt(weight_decay_lr))


# ---------------------------------------------------------------- the update formulas
# Arguments in the update ops' order: the variable, its slots, the gradient, then scalars.


def sgd(p, m, g, lr, momentum, weight_decay, nesterov):
    """SGD with coupled weight decay and (Nesterov) momentum, as torch.optim.SGD: returns
    (p', m'). With momentum 0, m is not read (it may be None) and comes back as given."""
    if weight_decay != 0:
        g = g + weight_decay * p
    if momentum != 0:
        m = momentum * m + g
        step = g + momentum * m if nesterov else m
    else:
        step = g
    return p - lr * step, m


def adam(p, m, v, g, lr_t, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, epsilon,
         weight_decay_lr):
    """Adam with TF's epsilon placement; weight_decay_lr != 0 first decays p (AdamW).
    Returns (p', m', v'). g is scaled before it is squared: (1 - beta_2) * g * g."""
    if weight_decay_lr != 0:
        p = p - weight_decay_lr * p
    m = beta_1 * m + one_minus_beta_1 * g
    v = beta_2 * v + one_minus_beta_2 * g * g
    return p - lr_t * m / (sqrt(v) + epsilon), m, v


def scalar_form(formula):
    """`formula` as the Numba kernels compile it (CPU and CUDA): the same code, with
    math.sqrt for numpy's ufunc, which Numba's CUDA target cannot type (both round the
    square root correctly, so the bits are the same)."""
    return types.FunctionType(formula.__code__, {**formula.__globals__, "sqrt": math.sqrt},
                              formula.__name__, formula.__defaults__, formula.__closure__)


# ---------------------------------------------------------------- in-place numpy programs


class ChunkProgram:
    """A formula's ufuncs for one branch, each writing `out=` into a kept array (the
    variable and its slots, updated in place) or a scratch array.

    Call it as program(kept, reads, scratch, scalars): `kept` the arrays updated in place
    ("k" in the layout, in order), `reads` those only read ("r": the gradient), `scratch`
    at least `self.scratch` arrays of their size, `scalars` the formula's scalars.
    """

    def __init__(self, steps: list, scratch: int):
        self.steps = steps          # [(ufunc, operand refs, out ref)]; a ref: (space, index)
        self.scratch = scratch

    def __call__(self, kept, reads, scratch, scalars) -> None:
        spaces = {"kept": kept, "read": reads, "scratch": scratch, "scalar": scalars}
        for ufunc, operands, (space, index) in self.steps:
            ufunc(*(spaces[s][i] for s, i in operands), out=spaces[space][index])


_programs: dict = {}     # (formula, layout, static args) -> [(branch guards, program)]


def chunk_program(formula, layout: str, scalars: tuple, static: tuple = ()) -> ChunkProgram:
    """The ChunkProgram of `formula(*arrays, *scalars, *static)` for these scalars' branches.
    `layout` has a letter per array argument: "k" an array updated in place by the
    formula's result in that position, "r" one only read, "-" none passed (None): sgd's
    "k-r" is plain SGD (p, no buffer, g). Traced once per branch taken (cached with the
    comparisons it made); other scalar values reuse it."""
    key = (formula, layout, static)
    for guards, program in _programs.get(key, ()):
        if all(_compare(scalars[i], op, other) == want for i, op, other, want in guards):
            return program
    guards, program = _trace(formula, layout, scalars, static)
    _programs.setdefault(key, []).append((guards, program))
    return program


_COMPARE = {"!=": lambda a, b: a != b, "==": lambda a, b: a == b}


def _compare(value, op: str, other) -> bool:
    return bool(_COMPARE[op](value, other))


class _Tape:
    def __init__(self):
        self.steps: list = []        # (ufunc, operand values)
        self.guards: list = []       # (scalar index, op, number, result)

    def emit(self, ufunc, *operands) -> _Value:
        refs = []
        for x in operands:
            if isinstance(x, (_Value, _Scalar)):
                refs.append(x.ref)
            else:
                raise TypeError(f"chunk_program: a formula may combine arrays and its scalars "
                                f"only, got {type(x).__name__} {x!r}: pass it as a scalar")
        self.steps.append((ufunc, tuple(refs)))
        return _Value(self, ("step", len(self.steps) - 1))


def _binary(ufunc, reflected: bool = False):
    def method(self, other):
        if isinstance(self, _Scalar) and isinstance(other, _Scalar):
            raise TypeError("chunk_program: a formula may not compute from scalars alone: "
                            "do it once where the scalars are rounded")
        return self.tape.emit(ufunc, other, self) if reflected else \
            self.tape.emit(ufunc, self, other)
    return method


class _Value:
    """An array operand of a formula being traced: arithmetic records ufuncs."""

    __array_priority__ = 1000

    def __init__(self, tape: _Tape, ref: tuple):
        self.tape, self.ref = tape, ref

    __add__, __radd__ = _binary(np.add), _binary(np.add, True)
    __sub__, __rsub__ = _binary(np.subtract), _binary(np.subtract, True)
    __mul__, __rmul__ = _binary(np.multiply), _binary(np.multiply, True)
    __truediv__, __rtruediv__ = _binary(np.divide), _binary(np.divide, True)

    def __neg__(self):
        return self.tape.emit(np.negative, self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs or ufunc.nin != 1 or ufunc.nout != 1:
            return NotImplemented
        return self.tape.emit(ufunc, *inputs)

    def __bool__(self):
        raise TypeError("chunk_program: a formula may not branch on an array")


class _Scalar:
    """A scalar of a formula being traced: comparisons with numbers give the true answer
    (and are remembered as guards), arithmetic with arrays records ufuncs."""

    def __init__(self, tape: _Tape, index: int, value):
        self.tape, self.index, self.value = tape, index, value
        self.ref = ("scalar", index)

    def _guard(self, op: str, other):
        if isinstance(other, (_Value, _Scalar)):
            raise TypeError("chunk_program: a formula may compare a scalar with a number only")
        result = _compare(self.value, op, other)
        self.tape.guards.append((self.index, op, other, result))
        return result

    def __ne__(self, other):
        return self._guard("!=", other)

    def __eq__(self, other):
        return self._guard("==", other)

    def __bool__(self):
        return self._guard("!=", 0)

    __hash__ = None

    __add__, __radd__ = _binary(np.add), _binary(np.add, True)
    __sub__, __rsub__ = _binary(np.subtract), _binary(np.subtract, True)
    __mul__, __rmul__ = _binary(np.multiply), _binary(np.multiply, True)
    __truediv__, __rtruediv__ = _binary(np.divide), _binary(np.divide, True)


def _trace(formula, layout: str, scalars: tuple, static: tuple):
    tape, arrays, counts = _Tape(), [], {"k": 0, "r": 0}
    for letter in layout:
        if letter == "-":
            arrays.append(None)
            continue
        arrays.append(_Value(tape, ("kept" if letter == "k" else "read", counts[letter])))
        counts[letter] += 1
    results = formula(*arrays, *(_Scalar(tape, i, s) for i, s in enumerate(scalars)),
                      *static)
    finals = [_final_ref(formula.__name__, j, r)
              for j, (letter, r) in enumerate(zip(layout, results)) if letter == "k"]
    return tape.guards, _allocate(formula.__name__, tape.steps, finals)


def _final_ref(name: str, position: int, result):
    """Where a kept array's new value comes from: a traced value, or None (not updated)."""
    if result is not None and not isinstance(result, _Value):
        raise TypeError(f"chunk_program: {name}'s result {position} is not an array "
                        f"(got {type(result).__name__}), so it cannot update one in place")
    return None if result is None else result.ref


def _allocate(name: str, steps: list, finals: list) -> ChunkProgram:
    """Give each step's result a buffer: kept array k for the step making its final value;
    else the buffer of an operand that dies there (in place, as ufuncs allow), unless that
    is a kept array still needed for its final value; else a free scratch buffer."""
    final_step = {}
    for k, ref in enumerate(finals):
        if ref is None or ref == ("kept", k):
            continue                              # unchanged (or not updated): no step
        if ref[0] != "step" or ref[1] in final_step.values():
            raise ValueError(f"chunk_program: {name}'s result {k} is not a value of its own")
        final_step[k] = ref[1]
    slot_of = {i: k for k, i in final_step.items()}
    last_use = {}
    for i, (_, operands) in enumerate(steps):
        for ref in operands:
            last_use[ref] = i
    for k, i in final_step.items():
        last_use[("step", i)] = len(steps)        # lives to the end, in kept array k
    where = {("kept", k): ("kept", k) for k in range(len(finals))}
    holder = {("kept", k): ("kept", k) for k in range(len(finals))}   # buffer -> value
    free, scratch, program = [], 0, []
    for i, (ufunc, operands) in enumerate(steps):
        dying = [where[r] for r in dict.fromkeys(operands)
                 if r[0] != "scalar" and r[0] != "read" and last_use.get(r) == i]
        for buf in dying:
            del holder[buf]
        if i in slot_of:
            out = ("kept", slot_of[i])
            if out in holder:
                raise ValueError(f"chunk_program: {name} needs kept array {slot_of[i]} "
                                 "after its new value is made")
        else:
            out = next((b for b in dying if b[0] == "scratch" or
                        final_step.get(b[1], -1) >= last_use.get(("step", i), i)), None)
            if out is None and free:
                out = free.pop(0)
            elif out is None:
                out, scratch = ("scratch", scratch), scratch + 1
        for buf in dying:
            if buf != out and buf[0] == "scratch":
                free.append(buf)
        free = [b for b in free if b != out]
        holder[out] = ("step", i)
        where[("step", i)] = out
        program.append((ufunc, tuple(where.get(r, r) for r in operands), out))
    return ChunkProgram(program, scratch)
