"""The in-place numpy forms of the CPU update kernels (runtime/numpy_updates.py), which a
program's first calls and gd.config.set_fused_kernels(False) run: on random inputs each
gives the bits of its Numba kernel and of the op's functional numpy impl, for every update
kind (momentum, Nesterov, weight decay, AdamW), across chunk boundaries."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops import OPS
from graphdist.runtime import kernel_table, numpy_updates, warmup

SHAPES = [(numpy_updates.CHUNK + 7,), (13, 5), ()]   # two chunks, a small one, a 0-d one
F32 = np.float32

# update op -> hyper vectors to try: [lr, wd]; [lr, momentum, wd]; Adam's [lr_t, b1, b2, eps]
# and AdamW's [..., lr * wd]
HYPERS = {
    "sgd": [[0.03, 0.0], [0.03, 0.01]],
    "sgd_momentum": [[0.03, 0.9, 0.0], [0.03, 0.9, 0.01], [0.03, 0.0, 0.01]],
    "adam": [[0.0123, 0.9, 0.999, 1e-7], [0.0123, 0.9, 0.999, 1e-7, 3e-4]],
}
SLOTS = {"sgd": 0, "sgd_momentum": 1, "adam": 2}      # m, v beside p


def _cases():
    for kind, hypers in HYPERS.items():
        for hyper, nesterov in itertools.product(hypers, [False, True]):
            if nesterov and kind != "sgd_momentum":
                continue
            yield kind, hyper, {"nesterov": nesterov} if kind == "sgd_momentum" else {}


CASES = list(_cases())
IDS = [("adamw" if len(h) == 5 else kind if kind != "sgd_momentum" else
        ("nesterov" if p["nesterov"] else "momentum") + ("-0" if h[1] == 0 else ""))
       + ("-decay" if kind != "adam" and h[-1] else "") for kind, h, p in CASES]


def _tensor(rng, shape, kind: str):
    """p, its slots (m, and Adam's v >= 0) and g, of shape `shape`."""
    arrays = [rng.standard_normal(shape).astype(F32)]
    arrays += [rng.standard_normal(shape).astype(F32) * F32(0.1)][:SLOTS[kind]]
    if SLOTS[kind] == 2:
        arrays.append((rng.standard_normal(shape) ** 2).astype(F32) * F32(0.01))
    return [np.asarray(a, F32) for a in arrays] + [rng.standard_normal(shape).astype(F32)]


def _run_three_ways(name: str, ins: list, params: dict):
    """The op on `ins` by its Numba kernel, its numpy form (both in place) and its impl:
    the three lists of updated arrays."""
    op = OPS[name]
    inplace = op.inplace(tuple(params.items())) if callable(op.inplace) else op.inplace
    results = []
    entry = kernel_table.entry("cpu", name)
    for form in (entry.kernel, entry.numpy):
        args = [x.copy() for x in ins]
        form(*args, **params)
        results.append([args[j] for j in inplace.values()])
    made = op.impl(np, *ins, **params)
    made = made if isinstance(made, tuple) else (made,)
    results.append([made[o] for o in inplace])
    return results


def _assert_same_bits(results, before):
    kernel, numpy_form, impl = results
    assert len(kernel) == len(before)
    for a, b, c in zip(kernel, numpy_form, impl):
        bits = np.asarray(a).view(np.uint32)
        np.testing.assert_array_equal(np.asarray(b).view(np.uint32), bits)
        np.testing.assert_array_equal(np.asarray(c).view(np.uint32), bits)
    assert any(not np.array_equal(a, x) for a, x in zip(kernel, before))   # it updated


@pytest.mark.parametrize("kind, hyper, params", CASES, ids=IDS)
def test_single_and_multi_tensor_forms_give_the_kernels_bits(kind, hyper, params):
    rng = np.random.default_rng(0)
    h = np.array(hyper)
    tensors = [_tensor(rng, s, kind) for s in SHAPES]
    kept = SLOTS[kind] + 1
    results = _run_three_ways(f"{kind}_update", tensors[1] + [h], params)
    _assert_same_bits(results, tensors[1][:kept])
    multi = [x for t in tensors for x in t] + [h]
    results = _run_three_ways(f"{kind}_multi_update", multi, {"n": len(SHAPES), **params})
    _assert_same_bits(results, [x for t in tensors for x in t[:kept]])


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("kind, hyper, params", CASES, ids=IDS)
def test_the_all_reduce_with_every_replica_s_update_gives_the_kernels_bits(kind, hyper,
                                                                          params, reduce):
    replicas, shapes = 3, SHAPES[:2]
    rng = np.random.default_rng(7)
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
    ins = [rng.standard_normal(sum(sizes)).astype(F32) for _ in range(replicas)]
    kept = []
    for _ in range(replicas):
        for s in shapes:
            kept += _tensor(rng, s, kind)[:-1]
        kept.append(np.array(hyper))
    ins += kept
    params = {"update": f"{kind}_multi_update", "reduce": reduce, "offsets": offsets,
              "replicas": replicas, "n": len(shapes), **params}
    results = _run_three_ways("host_reduce_update", ins, params)
    _assert_same_bits(results, [x for x in kept if x.dtype == F32])


def test_a_gradient_that_is_the_variable_itself_is_read_before_the_update():
    rng = np.random.default_rng(3)
    p, m, v = (rng.standard_normal(100).astype(F32) ** 2 for _ in range(3))
    h = np.array(HYPERS["adam"][1])
    want = OPS["adam_update"].impl(np, p, m, v, p, h)
    numpy_updates.adam(p, m, v, p, h)           # g is p: AdamW's decay writes p first
    for got, expected in zip((p, m, v), want):
        np.testing.assert_array_equal(got, expected)


def test_unfused_programs_run_the_numpy_forms_without_a_warm_up():
    """fused=False runs the numpy forms: nothing for the background thread to load (were
    they noted as kernels, the program would start tiered), and the kernels' bits."""
    def train(fused):
        gd.config.set_fused_kernels(fused)
        try:
            rng = np.random.default_rng(0)
            ws = [gd.Variable(rng.standard_normal(s).astype(F32) * F32(0.1))
                  for s in [(32, 64), (64,), (64, 10)]]
            opt = gd.optimizers.AdamW(1e-2, weight_decay=0.01)
            x = rng.standard_normal((16, 32)).astype(F32)

            @gd.function
            def step():
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean((gd.relu(x @ ws[0] + ws[1]) @ ws[2]) ** 2)
                opt.apply_gradients(zip(tape.gradient(loss, ws), ws))

            for _ in range(3):
                step()
            return step, [w.numpy() for w in ws]
        finally:
            gd.config.set_fused_kernels(True)

    old = gd.config.background_compile()
    gd.config.set_background_compile(True)
    try:
        with warmup.paused():
            step, unfused = train(False)
            programs = [p for c in step._cache.values() for p in c.executable.programs]
            assert programs and not any(getattr(p, "warming", False) for p in programs)
        gd.config.set_background_compile(False)
        _, kernels = train(True)
    finally:
        gd.config.set_background_compile(old)
    for a, b in zip(unfused, kernels):
        np.testing.assert_array_equal(a, b)
