"""kernels/formulas.py: each optimizer update written once, and the hyper-parameter vector's
named fields. The formulas against hand-derived values; their in-place chunk programs (the
numpy forms) against the formulas on whole arrays, bit for bit, every branch; the Numba
kernels, the numpy forms and the op impls all built from the same code; the vectors'
encode/decode by name."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graphdist.kernels import adam as adam_kernels
from graphdist.kernels import formulas
from graphdist.kernels import reduce_update
from graphdist.kernels import sgd as sgd_kernels
from graphdist.kernels.formulas import AdamHyper, MomentumHyper, SGDHyper
from graphdist.ops import OPS
from graphdist.runtime import numpy_updates

F64 = np.float64


# ---------------------------------------------------------------- the formulas' values

def test_sgd_formula_gives_hand_derived_values():
    # p 1, m 0.5, g 2, lr 0.5, momentum 0.5, wd 0.25: g' = 2 + 0.25 * 1 = 2.25,
    # m' = 0.5 * 0.5 + 2.25 = 2.5; Nesterov's step g' + 0.5 * m' = 3.5, p' = 1 - 1.75
    p, m, g = (np.array([x]) for x in (1.0, 0.5, 2.0))
    p_new, m_new = formulas.sgd(p, m, g, F64(0.5), F64(0.5), F64(0.25), True)
    assert (p_new[0], m_new[0]) == (-0.75, 2.5)
    p_new, m_new = formulas.sgd(p, m, g, F64(0.5), F64(0.5), F64(0.25), False)
    assert (p_new[0], m_new[0]) == (1 - 0.5 * 2.5, 2.5)
    # momentum 0: plain SGD, the buffer neither read nor changed (it may be None)
    p_new, m_new = formulas.sgd(p, None, g, F64(0.5), F64(0.0), F64(0.0), False)
    assert p_new[0] == 0.0 and m_new is None


def test_adam_formula_gives_hand_derived_values():
    # m' = 0.5 * 0 + 0.5 * 2 = 1, v' = 0.75 * 0 + 0.25 * 2 * 2 = 1, p' = 1 - 0.5 * 1 / (1 + 0)
    p, m, v, g = (np.array([x]) for x in (1.0, 0.0, 0.0, 2.0))
    scalars = formulas.adam_scalars(AdamHyper(0.5, 0.5, 0.75, 0.0).encode(), p)
    assert [x[0] for x in formulas.adam(p, m, v, g, *scalars)] == [0.5, 1.0, 1.0]
    # AdamW decays first with the plain rate: p = 1 - 0.5 * 1 = 0.5, then 0.5 - 0.5
    scalars = formulas.adam_scalars(AdamHyper(0.5, 0.5, 0.75, 0.0, 0.5).encode(), p)
    assert formulas.adam(p, m, v, g, *scalars)[0][0] == 0.0


# ---------------------------------------------------------------- the hyper vectors

def test_hyper_vectors_encode_their_fields_in_order_and_decode_by_name():
    adam = AdamHyper(lr_t=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
    assert adam.encode() == (0.1, 0.9, 0.999, 1e-7)               # Adam: 4 entries
    adamw = adam._replace(weight_decay_lr=4e-4)
    assert adamw.encode() == (0.1, 0.9, 0.999, 1e-7, 4e-4)        # AdamW: 5
    assert AdamHyper.decode(np.array(adamw.encode())) == adamw
    assert AdamHyper.decode(np.array(adam.encode())).weight_decay_lr is None
    momentum = MomentumHyper(lr=0.1, momentum=0.9, weight_decay=0.01)
    assert MomentumHyper.decode(np.array(momentum.encode())) == momentum
    assert SGDHyper.decode(np.array([0.1, 0.01])) == SGDHyper(lr=0.1, weight_decay=0.01)


def test_a_vector_of_the_wrong_length_names_the_fields():
    with pytest.raises(ValueError, match=r"AdamHyper: expected 4 or 5 .*lr_t, beta_1"):
        AdamHyper.decode(np.array([0.1, 0.9, 0.999]))
    with pytest.raises(ValueError, match=r"SGDHyper: expected 2 .*lr, weight_decay"):
        SGDHyper.decode(np.array([0.1, 0.9, 0.0]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_scalars_are_the_named_fields_rounded_to_the_dtype(dtype):
    like, dt = np.zeros(1, dtype), dtype
    adamw = AdamHyper(lr_t=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay_lr=4e-4)
    got = formulas.adam_scalars(adamw.encode(), like)
    want = (dt(0.1), dt(0.9), dt(1 - 0.9), dt(0.999), dt(1 - 0.999), dt(1e-7), dt(4e-4))
    assert got == want and all(type(x) is dt for x in got)
    assert formulas.adam_scalars(adamw._replace(weight_decay_lr=None).encode(), like)[-1] == 0
    assert formulas.sgd_scalars(MomentumHyper(0.1, 0.9, 0.01).encode(), like) == \
        (dt(0.1), dt(0.9), dt(0.01))
    assert formulas.sgd_scalars(SGDHyper(0.1, 0.01).encode(), like) == (dt(0.1), 0, dt(0.01))


# ---------------------------------------------------------------- the in-place chunk programs

CASES = {   # name: (formula, layout, hyper vector, static args)
    "sgd": (formulas.sgd, "k-r", [0.03, 0.0], (False,)),
    "sgd-decay": (formulas.sgd, "k-r", [0.03, 0.01], (False,)),
    "momentum": (formulas.sgd, "kkr", [0.03, 0.9, 0.0], (False,)),
    "momentum-decay": (formulas.sgd, "kkr", [0.03, 0.9, 0.01], (False,)),
    "momentum-0": (formulas.sgd, "kkr", [0.03, 0.0, 0.01], (False,)),
    "nesterov-decay": (formulas.sgd, "kkr", [0.03, 0.9, 0.01], (True,)),
    "adam": (formulas.adam, "kkkr", [0.0123, 0.9, 0.999, 1e-7], ()),
    "adamw": (formulas.adam, "kkkr", [0.0123, 0.9, 0.999, 1e-7, 3e-4], ()),
}
SCALARS = {formulas.sgd: formulas.sgd_scalars, formulas.adam: formulas.adam_scalars}


def _operands(rng, layout: str, dtype, n: int = 1000) -> list:
    arrays = []
    for letter in layout:
        x = None if letter == "-" else (rng.standard_normal(n) * 0.5).astype(dtype)
        arrays.append(x)
    if layout == "kkkr":
        arrays[2] = np.abs(arrays[2])                 # Adam's v >= 0
    return arrays


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_chunk_program_gives_the_formulas_bits_in_place(case, dtype):
    formula, layout, hyper, static = CASES[case]
    arrays = _operands(np.random.default_rng(len(case)), layout, dtype)
    scalars = SCALARS[formula](hyper, arrays[0])
    expected = formula(*arrays, *scalars, *static)
    program = formulas.chunk_program(formula, layout, scalars, static)
    kept = [x.copy() for x, letter in zip(arrays, layout) if letter == "k"]
    reads = [x for x, letter in zip(arrays, layout) if letter == "r"]
    program(kept, reads, [np.empty_like(arrays[0]) for _ in range(program.scratch)], scalars)
    want = [e for e, letter in zip(expected, layout) if letter == "k"]
    for got, exp in zip(kept, want):
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), exp.view(f"u{got.itemsize}"))
    assert program.scratch <= numpy_updates.SCRATCH
    assert any(not np.array_equal(k, x) for k, x in zip(kept, arrays))    # it updated


def test_a_program_is_traced_once_per_branch_and_reused_for_other_values():
    like = np.zeros(1, np.float32)
    first = formulas.chunk_program(formulas.adam, "kkkr", formulas.adam_scalars(
        [0.1, 0.9, 0.999, 1e-7], like))
    other_rate = formulas.chunk_program(formulas.adam, "kkkr", formulas.adam_scalars(
        [0.2, 0.8, 0.99, 1e-6], like))
    decayed = formulas.chunk_program(formulas.adam, "kkkr", formulas.adam_scalars(
        [0.1, 0.9, 0.999, 1e-7, 1e-3], like))
    assert other_rate is first and decayed is not first
    assert len(decayed.steps) == len(first.steps) + 2           # p - wd * p: two ufuncs
    # the ufuncs themselves, in the formula's order: no temporaries, no copies
    assert [u.__name__ for u, _, _ in first.steps] == [
        "multiply", "multiply", "add",                          # b1 * m + c1 * g
        "multiply", "multiply", "multiply", "add",              # b2 * v + c2 * g * g
        "multiply", "sqrt", "add", "divide", "subtract"]        # p - lr_t * m / (sqrt(v) + eps)


def test_chunk_program_refuses_what_it_cannot_replay():
    def from_scalars_alone(p, g, lr):
        return (p - (1 - lr) * g,)

    with pytest.raises(TypeError, match="chunk_program: a formula may combine arrays"):
        formulas.chunk_program(from_scalars_alone, "kr", (F64(0.5),))

    def branches_on_an_array(p, g, lr):
        return (p - lr * g if g else p,)

    with pytest.raises(TypeError, match="may not branch on an array"):
        formulas.chunk_program(branches_on_an_array, "kr", (F64(0.5),))

    def swaps(p, m, lr):          # p's new value is made while m's still needs the old p
        return m * lr, p * lr

    with pytest.raises(ValueError, match="needs kept array 0 after its new value is made"):
        formulas.chunk_program(swaps, "kk", (F64(0.5),))


# ---------------------------------------------------------------- one source for every path

@pytest.mark.parametrize("kernel, formula", [
    (sgd_kernels._sgd_cpu_math, formulas.sgd), (sgd_kernels._sgd_gpu_math, formulas.sgd),
    (adam_kernels._adam_cpu_math, formulas.adam), (adam_kernels._adam_gpu_math, formulas.adam),
    (sgd_kernels._sgd_gpu_hyper, formulas.sgd_scalars),
    (adam_kernels._adam_gpu_hyper, formulas.adam_scalars),
])
def test_the_numba_kernels_compile_the_formulas_own_code(kernel, formula):
    # scalar_form gives Numba the same code object, with math.sqrt for numpy's ufunc
    assert kernel.py_func.__code__ is formula.__code__
    if formula in (formulas.sgd, formulas.adam):
        assert kernel.py_func.__globals__["sqrt"] is math.sqrt


def test_the_fused_reduce_update_and_the_numpy_forms_use_them_too():
    assert reduce_update._sgd_cpu_math is sgd_kernels._sgd_cpu_math
    assert reduce_update._adam_cpu_math is adam_kernels._adam_cpu_math
    assert {formula for _, formula, _ in numpy_updates.UPDATES.values()} == \
        {formulas.sgd, formulas.adam}


@pytest.mark.parametrize("name, formula", [
    ("sgd_update", "sgd"), ("sgd_momentum_update", "sgd"), ("adam_update", "adam")])
def test_the_op_impls_are_the_formulas(monkeypatch, name, formula):
    """The functional impl computes through formulas.<formula> (counted), on the op's own
    argument order, with the vector decoded by formulas' scalars."""
    calls = []
    real = getattr(formulas, formula)
    monkeypatch.setattr(formulas, formula, lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(5)
    k = {"sgd_update": 2, "sgd_momentum_update": 3, "adam_update": 4}[name]
    arrays = [np.abs(rng.standard_normal(4)) for _ in range(k)]
    hyper = np.array({2: [0.1, 0.0], 3: [0.1, 0.9, 0.0], 4: [0.1, 0.9, 0.999, 1e-7]}[k])
    params = {"nesterov": False} if name == "sgd_momentum_update" else {}
    OPS[name].impl(np, *arrays, hyper, **params)
    gradient_at = 3 if formula == "adam" else 2        # (p, m, v, g) or (p, m or None, g)
    assert len(calls) == 1
    assert calls[0][0] is arrays[0] and calls[0][gradient_at] is arrays[-1]
