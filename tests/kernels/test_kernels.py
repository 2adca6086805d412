"""The CPU kernels of graphdist.kernels against their numpy references, at real sizes.

The CUDA kernels run in tests/kernels/test_kernels_cudasim.py (simulator) and tests/gpu/ (a real GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
from graphdist.kernels import adam, common, reduce, sgd

DTYPES = [np.float32, np.float64]
RTOL = {np.float32: 1e-6, np.float64: 1e-12}
SIZES = [1, 7, 1000, 100003]  # 100003 spans two multi-tensor chunks
SHAPES = [(), (7,), (25, 40), (100003,), (0,), (3, 1, 5)]


def _close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=RTOL[expected.dtype.type], atol=0)


def _randn(rng, shape, dtype, scale=1.0):
    return np.asarray(scale * rng.standard_normal(shape), dtype)  # 0-d stays an array


SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.05, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_cpu_matches_ref(dtype, config):
    rng = np.random.default_rng(0)
    for n in SIZES:
        p, m = _randn(rng, n, dtype), np.zeros(n, dtype)
        p_ref, m_ref = p.copy(), (m.copy() if config.get("momentum") else None)
        for _ in range(3):
            g = _randn(rng, n, dtype)
            p_ref, m_ref = sgd.sgd_ref(p_ref, m_ref, g, **config)
            sgd.sgd_cpu(p, m if config.get("momentum") else None, g, **config)
            _close(p, p_ref)
            if m_ref is not None:
                _close(m, m_ref)
        assert p.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_multi_cpu_matches_per_tensor_ref(dtype, config):
    rng = np.random.default_rng(1)
    ps = [_randn(rng, s, dtype) for s in SHAPES]
    ms = [np.zeros(s, dtype) for s in SHAPES]
    refs = [(p.copy(), m.copy() if config.get("momentum") else None) for p, m in zip(ps, ms)]
    for _ in range(3):
        gs = [_randn(rng, s, dtype) for s in SHAPES]
        refs = [sgd.sgd_ref(p, m, g, **config) for (p, m), g in zip(refs, gs)]
        sgd.sgd_multi_cpu(ps, ms if config.get("momentum") else None, gs, **config)
        for p, m, (p_ref, m_ref) in zip(ps, ms, refs):
            _close(p, p_ref)
            if m_ref is not None:
                _close(m, m_ref)


def test_sgd_needs_a_momentum_buffer():
    p = np.ones(3)
    with pytest.raises(ValueError, match="momentum"):
        sgd.sgd_cpu(p, None, p.copy(), lr=0.1, momentum=0.9)


def _adam_args(t, lr=1e-3, beta_1=0.9, beta_2=0.999):
    lr_t = lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)  # np.float64: the kernels take any float
    return lr_t, beta_1, beta_2, 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_decay_lr", [0.0, 1e-3 * 0.004])
def test_adam_cpu_matches_ref(dtype, weight_decay_lr):
    rng = np.random.default_rng(2)
    for n in SIZES:
        p, m, v = _randn(rng, n, dtype), np.zeros(n, dtype), np.zeros(n, dtype)
        ref = p.copy(), m.copy(), v.copy()
        for t in range(1, 4):
            g = _randn(rng, n, dtype, scale=10.0**-t)
            p_ref, m_ref, v_ref = ref
            ref = adam.adam_ref(p_ref, m_ref, v_ref, g, *_adam_args(t), weight_decay_lr)
            if weight_decay_lr:
                adam.adamw_cpu(p, m, v, g, *_adam_args(t), weight_decay_lr)
            else:
                adam.adam_cpu(p, m, v, g, *_adam_args(t))
            for actual, expected in zip((p, m, v), ref):
                assert actual.dtype == expected.dtype == dtype
                _close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_decay_lr", [0.0, 0.01])
def test_adam_multi_cpu_matches_per_tensor_ref(dtype, weight_decay_lr):
    rng = np.random.default_rng(3)
    ps = [_randn(rng, s, dtype) for s in SHAPES]
    ms, vs = [np.zeros(s, dtype) for s in SHAPES], [np.zeros(s, dtype) for s in SHAPES]
    refs = [(p.copy(), m.copy(), v.copy()) for p, m, v in zip(ps, ms, vs)]
    # typed lists kept across steps, as the executor does for parameters and slots
    lists = [common.tensor_list(x) for x in (ps, ms, vs)]
    for t in range(1, 4):
        gs = [_randn(rng, s, dtype) for s in SHAPES]
        refs = [
            adam.adamw_ref(p, m, v, g, *_adam_args(t), weight_decay_lr)
            for (p, m, v), g in zip(refs, gs)
        ]
        adam.adam_multi_cpu(lists[0], lists[1], lists[2], gs, *_adam_args(t), weight_decay_lr)
        for arrays, ref in zip(zip(ps, ms, vs), refs):
            for actual, expected in zip(arrays, ref):
                _close(actual, expected)


def test_adamw_decays_with_plain_lr_before_the_step():
    p, m, v, g = np.full(1, 2.0), np.zeros(1), np.zeros(1), np.zeros(1)
    adam.adamw_multi_cpu([p], [m], [v], [g], 0.1, 0.9, 0.999, 1e-7, 0.25)
    assert p[0] == 1.5  # g = 0: only the decoupled decay moves p


def test_multi_cpu_checks_its_inputs():
    a, b = np.zeros(3, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="size"):
        adam.adam_multi_cpu([a], [b], [a], [a], 0.1, 0.9, 0.999, 1e-7)
    with pytest.raises(ValueError, match="length"):
        sgd.sgd_multi_cpu([a, a], None, [a], lr=0.1)
    with pytest.raises(TypeError, match="dtype"):
        sgd.sgd_multi_cpu([a, np.zeros(3)], None, [a, a], lr=0.1)
    with pytest.raises(TypeError, match="dtype"):
        adam.adam_cpu(a, a.astype(np.float64), a, a, 0.1, 0.9, 0.999, 1e-7)
    with pytest.raises(TypeError, match="ndarray"):
        sgd.sgd_cpu(np.float32(1), None, np.float32(1), lr=0.1)  # a scalar has no buffer
    with pytest.raises(ValueError, match="contiguous"):
        sgd.sgd_cpu(np.zeros((4, 4))[:, 0], None, np.zeros(4), lr=0.1)
    sgd.sgd_multi_cpu([], None, [], lr=0.1)  # no tensors: nothing to do


def test_chunk_table_covers_every_element_once():
    tensors = common.tensor_list([np.zeros(n) for n in (0, 1, 7, 20, 16)])
    table = common.chunk_table(common.sizes_of(tensors), 8)  # (rows, 3): tensor, start, stop
    assert table.tolist() == [
        [1, 0, 1],
        [2, 0, 7],
        [3, 0, 8],
        [3, 8, 16],
        [3, 16, 20],
        [4, 0, 8],
        [4, 8, 16],
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", [1, 7, 1000, 4097])
def test_all_reduce_cpu_matches_ref(dtype, op, n):
    rng = np.random.default_rng(n)
    for count in range(1, 5):
        bufs = [_randn(rng, (n,), dtype) for _ in range(count)]
        expected = reduce.all_reduce_ref(bufs, op)
        out = np.empty_like(bufs[0])
        assert reduce.all_reduce_cpu(bufs, op, out=out) is out
        _close(out, expected)
        reduce.all_reduce_cpu(bufs, op)  # in place: every buffer gets the result
        for b in bufs:
            _close(b, expected)


def test_all_reduce_is_deterministic_and_ordered():
    bufs = [np.array([1e8], np.float32), np.array([1.0], np.float32), np.array([-1e8], np.float32)]
    out = np.empty(1, np.float32)
    reduce.all_reduce_cpu(bufs, out=out)
    assert out[0] == np.float32(0.0)  # ((1e8 + 1) - 1e8) in float32, list order
    two_d = [np.arange(6.0).reshape(2, 3), np.ones((2, 3))]
    reduce.all_reduce_cpu(two_d, "mean")
    np.testing.assert_array_equal(two_d[1], (np.arange(6.0).reshape(2, 3) + 1) / 2)


def test_all_reduce_checks_its_inputs():
    a, b = np.zeros(3), np.zeros(3)
    with pytest.raises(ValueError, match="op"):
        reduce.all_reduce_cpu([a, b], op="max")
    with pytest.raises(ValueError, match="overlaps"):
        reduce.all_reduce_cpu([a, b], out=b)
    with pytest.raises(ValueError, match="size"):
        reduce.all_reduce_cpu([a, np.zeros(4)])
    reduce.all_reduce_cpu([a, b], out=a)  # out may be bufs[0]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (np.float32, np.float32),
        (np.float32, np.float64),
        (np.float64, np.float32),
        (np.float64, np.float64),
    ],
)
def test_scale_cpu_matches_ref(src, dst):
    rng = np.random.default_rng(4)
    for n in SIZES:
        x = _randn(rng, (n,), src)
        out = np.empty(n, dst)
        reduce.scale_cpu(x, 0.1, out)
        expected = reduce.scale_ref(x, 0.1, dst)
        assert expected.dtype == dst
        np.testing.assert_array_equal(out, expected)
        if src == dst:
            before = x.copy()
            reduce.scale_cpu(x, 1 / 3, x)  # in place
            np.testing.assert_array_equal(x, reduce.scale_ref(before, 1 / 3))


@pytest.mark.parametrize("count", [16, 17, 40])
def test_more_tensors_than_a_tuple_holds_run_in_groups_with_the_same_bits(count):
    """Past 16 tensors the CPU multi-tensor kernels run one call per 16 (tuples, not typed
    Lists); every tensor still gets exactly its own per-tensor update."""
    rng = np.random.default_rng(7)
    shapes = [(int(rng.integers(1, 300)),) for _ in range(count)]
    ps = [_randn(rng, s, np.float32) for s in shapes]
    ms, vs = [np.zeros(s, np.float32) for s in shapes], [np.zeros(s, np.float32) for s in shapes]
    sgd_ps, sgd_ms = [p.copy() for p in ps], [m.copy() for m in ms]
    refs = [(p.copy(), m.copy(), v.copy()) for p, m, v in zip(ps, ms, vs)]
    sgd_refs = [(p.copy(), m.copy()) for p, m in zip(ps, ms)]
    for t in range(1, 3):
        gs = [_randn(rng, s, np.float32) for s in shapes]
        refs = [adam.adam_ref(p, m, v, g, *_adam_args(t)) for (p, m, v), g in zip(refs, gs)]
        sgd_refs = [sgd.sgd_ref(p, m, g, lr=0.1, momentum=0.9)
                    for (p, m), g in zip(sgd_refs, gs)]
        adam.adam_multi_cpu(ps, ms, vs, gs, *_adam_args(t))
        sgd.sgd_multi_cpu(sgd_ps, sgd_ms, gs, lr=0.1, momentum=0.9)
        for arrays, ref in zip(zip(ps, ms, vs), refs):
            for actual, expected in zip(arrays, ref):
                np.testing.assert_array_equal(actual, expected)
        for arrays, ref in zip(zip(sgd_ps, sgd_ms), sgd_refs):
            for actual, expected in zip(arrays, ref):
                np.testing.assert_array_equal(actual, expected)
