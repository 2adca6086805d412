"""device/threads.py split_batch: a batch's images split over the cores, one BLAS thread
each, where the caller has every core (one program); the convolutions that use it
(conv2d_bias_act, conv2d_backprop_input on the CPU) give the same bits either way."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from graphdist.device import threads
from graphdist.ir.types import ArrayType
from graphdist.runtime import kernel_table


@pytest.fixture
def two_cores(monkeypatch):
    """Two cores, whatever the host has, and no size threshold: every call may split."""
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 0)
    threads.set_blas_threads(None)
    yield
    threads.set_blas_threads(None)


def test_the_parts_cover_the_batch_once_on_threads_of_their_own(two_cores):
    seen, names = [], set()

    def run(part):
        seen.append((part.start, part.stop))
        names.add(threading.current_thread().name.startswith("graphdist-split"))

    threads.split_batch(7, run, out_bytes=1)
    assert sorted(seen) == [(0, 3), (3, 7)] and names == {True, False}
    assert threads._blas_now[0] == 2                      # restored after the parts


def test_each_part_runs_its_numba_kernels_on_its_share_of_the_threads(two_cores):
    """Each part's Numba kernels get its share of the cores too (Numba's thread count is
    thread-local): two parts each launching two Numba threads ran four on two cores, and
    the tutorial CNN's step took 18.2-18.8 ms against 16.5-17.0 with one each. A large
    kernel in a part runs on one thread; the caller wants what it wanted before after."""
    import numba

    from graphdist.kernels.common import want_numba_threads
    from graphdist.kernels.relu import relu_grad_cpu

    before = want_numba_threads(None)
    want_numba_threads(before)
    counts = []

    def run(part):
        ct = np.ones(1 << 19, np.float32)          # 2 MiB: a large kernel
        assert relu_grad_cpu(ct, ct, np.empty_like(ct))
        counts.append(numba.get_num_threads())

    threads.split_batch(8, run, out_bytes=1)
    assert counts == [1, 1]
    assert want_numba_threads(before) == before


def test_no_split_for_one_item_small_work_or_a_device_worker(two_cores, monkeypatch):
    seen = []
    threads.split_batch(1, seen.append, out_bytes=1)
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 100)
    threads.split_batch(8, seen.append, out_bytes=99)
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 0)
    threads.set_blas_threads(1)          # a thread-per-device worker's share
    threads.split_batch(8, seen.append, out_bytes=1)
    assert seen == [slice(0, 1), slice(0, 8), slice(0, 8)]


def test_an_error_in_a_part_reaches_the_caller_and_restores_the_threads(two_cores):
    def run(part):
        if part.start:
            raise ValueError("part 2 failed")

    with pytest.raises(ValueError, match="part 2 failed"):
        threads.split_batch(4, run, out_bytes=1)
    assert threads._blas_now[0] == 2


def _run(op_name, ins, params, twin=False):
    from graphdist.ops import OPS

    op = OPS[op_name]
    types = op.out_types(*(ArrayType(a.shape, a.dtype) for a in ins), **params)
    outs = tuple(np.full(t.shape, np.nan, t.dtype) for t in types)
    entry = kernel_table.entry("cpu", op_name)
    (entry.numpy_out if twin else entry.out)(outs if len(outs) > 1 else outs[0], *ins,
                                              **params)
    return outs


CONV = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}


@pytest.mark.parametrize("case", ["conv2d_bias_act", "conv2d_bias_act gelu", "input grad"])
def test_the_convolutions_split_give_their_twins_bits_and_the_whole_s_values(
        two_cores, monkeypatch, case):
    """Split, the kernel and its numpy twin (the first calls' form) split alike: the same
    bits. Against the whole batch in one piece the GEMMs' row blocks move, so the values
    agree to float32 rounding (OpenBLAS may sum a block's rows in another order)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 13, 13, 32)).astype(np.float32)
    f = rng.standard_normal((3, 3, 32, 16)).astype(np.float32)
    if case == "input grad":
        name, ins = "conv2d_backprop_input", (rng.standard_normal((9, 11, 11, 16)).astype(
            np.float32), f)
        params = {**CONV, "input_size": (13, 13)}
    else:
        act = "gelu_tanh" if "gelu" in case else "relu"
        name, ins = "conv2d_bias_act", (x, f, rng.standard_normal(16).astype(np.float32))
        params = {**CONV, "act": act, "has_bias": True, "keep": act != "relu",
                  "members": ("conv2d", "add", act)}
    split = _run(name, ins, params)
    for a, b in zip(split, _run(name, ins, params, twin=True)):
        assert not np.isnan(a).any()
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 1 << 62)          # never split
    for a, b in zip(split, _run(name, ins, params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_the_filter_gradient_sums_fixed_parts_whatever_runs_them(two_cores, monkeypatch):
    """A sum over the batch: split, always FILTER_GRAD_PARTS parts added in order, so the
    bits are the same on threads of their own, one after another (one core) and on a
    thread-per-device worker with its share of the BLAS threads (it once ran the batch
    whole there: a CNN step's bits then depended on another thread's BLAS setting at the
    moment); the values are the whole batch's to float32 rounding. One input channel:
    never split."""
    from graphdist.runtime.adapters.nn import conv2d_backprop_filter_parts

    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 13, 13, 32)).astype(np.float32)
    dy = rng.standard_normal((9, 11, 11, 16)).astype(np.float32)
    params = {**CONV, "filter_size": (3, 3)}
    (concurrent,) = _run("conv2d_backprop_filter", (x, dy), params)
    from graphdist.ops.conv import conv2d_backprop_filter_p

    whole = conv2d_backprop_filter_p.impl(np, x, dy, **params)
    threads.set_blas_threads(1)                       # a worker's share: the same parts
    np.testing.assert_array_equal(_run("conv2d_backprop_filter", (x, dy), params)[0],
                                  concurrent)
    monkeypatch.setattr(threads, "cores", lambda: 1)  # one core: the parts in turn
    threads.set_blas_threads(None)
    (one_core,) = _run("conv2d_backprop_filter", (x, dy), params)
    np.testing.assert_array_equal(concurrent, one_core)
    np.testing.assert_allclose(concurrent, whole, rtol=1e-5, atol=1e-3)
    halves = [conv2d_backprop_filter_p.impl(np, x[s], dy[s], **params)
              for s in (slice(0, 4), slice(4, 9))]
    np.testing.assert_array_equal(concurrent, halves[0] + halves[1])
    one = x[..., :1].copy()                            # one input channel: not split
    out = np.empty((3, 3, 1, 16), np.float32)
    conv2d_backprop_filter_parts(out, one, dy, **params)
    np.testing.assert_array_equal(out, conv2d_backprop_filter_p.impl(np, one, dy, **params))
