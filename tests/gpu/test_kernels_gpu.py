"""The CUDA kernels of graphdist.kernels against their numpy references.

Runs on a real GPU, and at tiny sizes under Numba's CUDA simulator, which
tests/kernels/test_kernels_cudasim.py starts in a child process with NUMBA_ENABLE_CUDASIM=1.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from graphdist.kernels import adam, reduce, sgd
from numba import cuda

SIM = bool(numba.config.ENABLE_CUDASIM)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.is_available(), reason="needs CUDA or NUMBA_ENABLE_CUDASIM=1"),
]

DTYPES = [np.float32, np.float64]
SIZES = [1, 7, 300] if SIM else [1, 7, 1000, 100003]  # the simulator runs threads in Python
# nvcc-style FMA contraction on the device rounds a*b + c once, so allow a few ulps of drift
TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-12, "atol": 1e-14}}


def _close(device_array, expected):
    np.testing.assert_allclose(device_array.copy_to_host(), expected, **TOL[expected.dtype.type])


def _randn(rng, shape, dtype):
    return np.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config", [{"lr": 0.1, "weight_decay": 0.01}, {"lr": 0.05, "momentum": 0.9, "nesterov": True}]
)
def test_sgd_gpu_matches_ref(dtype, config):
    rng, stream = np.random.default_rng(0), cuda.stream()
    momentum = config.get("momentum")
    for n in SIZES:
        p_ref, m_ref = _randn(rng, n, dtype), np.zeros(n, dtype) if momentum else None
        p, m = cuda.to_device(p_ref), cuda.to_device(np.zeros(n, dtype)) if momentum else None
        for _ in range(2):
            g = _randn(rng, n, dtype)
            p_ref, m_ref = sgd.sgd_ref(p_ref, m_ref, g, **config)
            sgd.sgd_gpu(p, m, cuda.to_device(g), **config, stream=stream)
        stream.synchronize()
        _close(p, p_ref)
        if momentum:
            _close(m, m_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_multi_gpu_matches_per_tensor_ref(dtype):
    rng, shapes = np.random.default_rng(1), [(), (3, 4), (SIZES[-1],)]
    refs = [(_randn(rng, s, dtype), np.zeros(s, dtype)) for s in shapes]
    ps, ms = [cuda.to_device(p) for p, _ in refs], [cuda.to_device(m) for _, m in refs]
    gs = [_randn(rng, s, dtype) for s in shapes]
    sgd.sgd_multi_gpu(ps, ms, [cuda.to_device(g) for g in gs], lr=0.1, momentum=0.9)
    for p, m, (p_ref, m_ref), g in zip(ps, ms, refs, gs):
        p_ref, m_ref = sgd.sgd_ref(p_ref, m_ref, g, lr=0.1, momentum=0.9)
        _close(p, p_ref)
        _close(m, m_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_decay_lr", [0.0, 0.01])
def test_adam_gpu_matches_ref(dtype, weight_decay_lr):
    rng = np.random.default_rng(2)
    for n in SIZES:
        ref = _randn(rng, n, dtype), np.zeros(n, dtype), np.zeros(n, dtype)
        p, m, v = (cuda.to_device(x) for x in ref)
        for t in range(1, 3):
            g = _randn(rng, n, dtype)
            lr_t = 1e-2 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
            ref = adam.adam_ref(*ref, g, lr_t, 0.9, 0.999, 1e-7, weight_decay_lr)
            adam.adamw_gpu(p, m, v, cuda.to_device(g), lr_t, 0.9, 0.999, 1e-7, weight_decay_lr)
        cuda.synchronize()
        for actual, expected in zip((p, m, v), ref):
            _close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_multi_gpu_matches_per_tensor_ref(dtype):
    rng, shapes = np.random.default_rng(3), [(), (3, 4), (SIZES[-1],)]
    refs = [(_randn(rng, s, dtype), np.zeros(s, dtype), np.zeros(s, dtype)) for s in shapes]
    ps, ms, vs = ([cuda.to_device(r[k]) for r in refs] for k in range(3))
    gs = [_randn(rng, s, dtype) for s in shapes]
    adam.adam_multi_gpu(
        ps, ms, vs, [cuda.to_device(g) for g in gs], 1e-2, 0.9, 0.999, 1e-7, weight_decay_lr=1e-4
    )
    cuda.synchronize()
    for arrays, (p, m, v), g in zip(zip(ps, ms, vs), refs, gs):
        for actual, expected in zip(
            arrays, adam.adam_ref(p, m, v, g, 1e-2, 0.9, 0.999, 1e-7, 1e-4)
        ):
            _close(actual, expected)


def test_multi_tensor_launches_cover_more_tensors_than_one_group():
    """21 tensors (empty ones among them, the largest cut into several chunks) in one
    launch: every tensor updated, none touched twice."""
    rng, dtype = np.random.default_rng(6), np.float32
    shapes = [(int(n),) for n in rng.integers(0, 90, 20)] + [(SIZES[-1],)]
    refs = [(_randn(rng, s, dtype), np.zeros(s, dtype), np.zeros(s, dtype)) for s in shapes]
    gs = [_randn(rng, s, dtype) for s in shapes]
    ps, ms, vs = ([cuda.to_device(r[k]) for r in refs] for k in range(3))
    # the hyper-parameters on the device, as a compiled step has them: [lr_t, b1, b2, eps]
    hyper = cuda.to_device(np.array([1e-2, 0.9, 0.999, 1e-7]))
    adam.adam_multi_gpu(ps, ms, vs, [cuda.to_device(g) for g in gs], hyper=hyper)
    sgd_ps = [cuda.to_device(r[0]) for r in refs]
    sgd.sgd_multi_gpu(sgd_ps, None, [cuda.to_device(g) for g in gs],
                      hyper=cuda.to_device(np.array([0.1, 0.0])))      # [lr, weight_decay]
    cuda.synchronize()
    for k, ((p, m, v), g) in enumerate(zip(refs, gs)):
        for actual, expected in zip((ps[k], ms[k], vs[k]),
                                    adam.adam_ref(p, m, v, g, 1e-2, 0.9, 0.999, 1e-7)):
            _close(actual, expected)
        _close(sgd_ps[k], sgd.sgd_ref(p, None, g, lr=0.1)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_hyper_vector_gives_the_host_numbers_bits(dtype):
    """The float64 hyper vector a compiled step passes is rounded on the device to the same
    numbers the host rounds: SGD momentum ([lr, momentum, wd]) and AdamW ([.., lr * wd]); a
    momentum of 0 in the momentum layout is plain SGD and leaves the buffer alone."""
    rng, shapes = np.random.default_rng(7), [(3, 4), (SIZES[-1],)]
    host = [(_randn(rng, s, dtype), _randn(rng, s, dtype), np.abs(_randn(rng, s, dtype)))
            for s in shapes]
    gs = [_randn(rng, s, dtype) for s in shapes]

    def run(kind, hyper=None, **numbers):
        arrays = [[cuda.to_device(x) for x in h] for h in host]
        ps, ms, vs = ([a[k] for a in arrays] for k in range(3))
        grads = [cuda.to_device(g) for g in gs]
        if kind == "sgd":
            sgd.sgd_multi_gpu(ps, ms, grads, nesterov=True, hyper=hyper, **numbers)
        else:
            adam.adam_multi_gpu(ps, ms, vs, grads, hyper=hyper, **numbers)
        cuda.synchronize()
        return [x.copy_to_host() for a in arrays for x in a]

    for kind, values, numbers in [
            ("sgd", [0.1, 0.9, 0.01], {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
            ("adam", [3e-3, 0.8, 0.99, 1e-6, 1e-4],
             {"lr_t": 3e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6,
              "weight_decay_lr": 1e-4})]:
        on_device = run(kind, hyper=cuda.to_device(np.array(values)))
        for a, b in zip(on_device, run(kind, **numbers)):
            np.testing.assert_array_equal(a, b)
    plain = run("sgd", hyper=cuda.to_device(np.array([0.1, 0.0, 0.0])))
    for (p, m, _), g, p_new, m_new in zip(host, gs, plain[0::3], plain[1::3]):
        np.testing.assert_allclose(p_new, sgd.sgd_ref(p, None, g, lr=0.1)[0], **TOL[dtype])
        np.testing.assert_array_equal(m_new, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_gpu_matches_ref(dtype, op):
    rng = np.random.default_rng(4)
    for n in [1, 7, 300 if SIM else 4097]:
        for count in range(1, 5):
            host = [_randn(rng, (n,), dtype) for _ in range(count)]
            expected = reduce.all_reduce_ref(host, op)
            out = cuda.device_array(n, dtype)
            reduce.all_reduce_gpu([cuda.to_device(b) for b in host], op, out=out)
            _close(out, expected)
            bufs = [cuda.to_device(b) for b in host]
            reduce.all_reduce_gpu(bufs, op)  # in place: every buffer gets the result
            for b in bufs:
                _close(b, expected)
            bufs = [cuda.to_device(b) for b in host]
            outs = [bufs[0]] + [cuda.device_array(n, dtype) for _ in host[1:]]
            reduce.all_reduce_gpu(bufs, op, outs=outs)  # one result per replica
            for o in outs:
                _close(o, expected)


@pytest.mark.parametrize(
    ("src", "dst"), [(np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float32)]
)
def test_scale_gpu_matches_ref(src, dst):
    x = _randn(np.random.default_rng(5), (SIZES[-1],), src)
    out = cuda.device_array(x.shape, dst)
    reduce.scale_gpu(cuda.to_device(x), 0.1, out)
    np.testing.assert_array_equal(out.copy_to_host(), reduce.scale_ref(x, 0.1, dst))


def test_multi_tensor_calls_on_the_same_buffers_see_their_new_values():
    """The second call reuses the first one's address tables (same buffers, as a compiled
    step passes them) and still reads the gradients written in between."""
    from graphdist.kernels import common

    rng, dtype = np.random.default_rng(7), np.float32
    shapes = [(5,), (3, 4), (SIZES[-1],)]
    p_ref = [_randn(rng, s, dtype) for s in shapes]
    m_ref = [np.zeros(s, dtype) for s in shapes]
    ps, ms = [cuda.to_device(p) for p in p_ref], [cuda.to_device(m) for m in m_ref]
    gs = [cuda.to_device(np.zeros(s, dtype)) for s in shapes]
    for step in range(2):
        grads = [_randn(rng, s, dtype) for s in shapes]
        for g, host in zip(gs, grads):
            g.copy_to_device(host)
        sgd.sgd_multi_gpu(ps, ms, gs, lr=0.1, momentum=0.9)
        for k, host in enumerate(grads):
            p_ref[k], m_ref[k] = sgd.sgd_ref(p_ref[k], m_ref[k], host, lr=0.1, momentum=0.9)
        if step == 0:
            prepared = common.gpu_tables(ps, ms, gs)
    assert common.gpu_tables(ps, ms, gs) is prepared
    cuda.synchronize()
    for p, m, pr, mr in zip(ps, ms, p_ref, m_ref):
        _close(p, pr)
        _close(m, mr)


def test_multi_tensor_tables_are_remembered_by_the_buffers_memory():
    """A compiled step's gradients are new arrays each step, in memory the pool hands out
    again: new array objects over the same memory reuse the tables, other memory (or the
    same memory seen as another shape) gets its own, and each update reads its own arrays."""
    from graphdist.kernels import common

    rng, dtype = np.random.default_rng(8), np.float32
    shapes = [(5,), (SIZES[-1],)]
    ps = [cuda.to_device(_randn(rng, s, dtype)) for s in shapes]
    before = [p.copy_to_host() for p in ps]
    gs = [cuda.to_device(_randn(rng, s, dtype)) for s in shapes]
    first = common.gpu_tables(ps, gs)
    again = [g[:] for g in gs]                       # new objects, the same memory
    assert again[0] is not gs[0]
    assert common.gpu_tables(ps, again) is first
    other = [cuda.to_device(g.copy_to_host()) for g in gs]
    assert common.gpu_tables(ps, other) is not first
    shorter = [[x[0], x[1][:-1]] for x in (ps, gs)]                   # a prefix of each
    assert common.gpu_tables(*shorter) is not first
    sgd.sgd_multi_gpu(ps, None, again, lr=0.5)
    sgd.sgd_multi_gpu(ps, None, other, lr=0.5)
    cuda.synchronize()
    for p, b, g in zip(ps, before, gs):
        _close(p, b - 0.5 * g.copy_to_host() - 0.5 * g.copy_to_host())
