"""Tests for graphdist.data.batches and graphdist.datasets.load_digits."""

from __future__ import annotations

import itertools
from collections import namedtuple

import numpy as np
import pytest

from graphdist.data import batches
from graphdist.datasets import load_digits


def _data(n=10):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64)
    return x, y


def test_array_in_array_out():
    x, _ = _data()
    out = list(batches(x, 4))
    assert len(out) == 2 and all(isinstance(b, np.ndarray) for b in out)
    np.testing.assert_array_equal(out[0], x[0:4])
    np.testing.assert_array_equal(out[1], x[4:8])


def test_tuple_in_tuple_out():
    x, y = _data()
    out = list(batches((x, y), 3, drop_remainder=False))
    assert [type(b) for b in out] == [tuple] * 4
    for i, (bx, by) in enumerate(out):
        np.testing.assert_array_equal(bx, x[3 * i : 3 * i + 3])
        np.testing.assert_array_equal(by, y[3 * i : 3 * i + 3])
        assert bx.dtype == x.dtype and by.dtype == y.dtype


def test_namedtuple_kept():
    Pair = namedtuple("Pair", "x y")
    x, y = _data()
    b = next(iter(batches(Pair(x, y), 5)))
    assert isinstance(b, Pair)
    np.testing.assert_array_equal(b.y, y[:5])


def test_dict_in_dict_out():
    x, y = _data()
    out = list(batches({"y": y, "x": x}, 5))
    assert len(out) == 2
    for i, b in enumerate(out):
        assert list(b) == ["y", "x"]
        np.testing.assert_array_equal(b["x"], x[5 * i : 5 * i + 5])
        np.testing.assert_array_equal(b["y"], y[5 * i : 5 * i + 5])


@pytest.mark.parametrize("n,size", [(10, 3), (10, 5), (10, 10), (10, 11), (7, 1), (0, 4)])
@pytest.mark.parametrize("drop", [True, False])
def test_counts_and_contents_match_slicing(n, size, drop):
    x, y = _data(n)
    ds = batches((x, y), size, drop_remainder=drop)
    expected = [
        (x[i : i + size], y[i : i + size]) for i in range(0, n, size) if not drop or i + size <= n
    ]
    out = list(ds)
    assert len(ds) == len(out) == len(expected)
    for (bx, by), (ex, ey) in zip(out, expected):
        np.testing.assert_array_equal(bx, ex)
        np.testing.assert_array_equal(by, ey)


def test_remainder_both_ways():
    x, _ = _data(10)
    assert [len(b) for b in batches(x, 4)] == [4, 4]
    assert [len(b) for b in batches(x, 4, drop_remainder=False)] == [4, 4, 2]


def test_reiterable():
    x, _ = _data()
    ds = batches(x, 4)
    first, second = [b.copy() for b in ds], [b.copy() for b in ds]
    assert len(first) == len(second) == 2
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_unshuffled_batches_are_read_only():
    x, _ = _data()
    b = next(iter(batches(x, 4)))
    with pytest.raises(ValueError):
        b[0, 0] = -1.0
    assert x.flags.writeable


def test_shuffle_is_a_permutation_each_epoch():
    x, y = _data(12)
    ds = batches((x, y), 4, shuffle=True, seed=3)
    epochs = []
    for _ in range(3):
        ys = np.concatenate([by for _, by in ds])
        np.testing.assert_array_equal(np.sort(ys), y)  # every example exactly once
        epochs.append(ys)
    for bx, by in ds:  # rows stay paired across entries
        np.testing.assert_array_equal(bx, x[by])
    assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])  # fresh permutation
    assert not np.array_equal(epochs[0], y)


def test_shuffle_deterministic_per_seed():
    x, _ = _data(50)

    def run(seed):
        ds = batches(x, 8, shuffle=True, seed=seed, drop_remainder=False)
        return [np.concatenate(list(ds)) for _ in range(2)]

    for a, b in zip(run(7), run(7)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(run(7)[0], run(8)[0])


def test_shuffle_drop_remainder():
    x, y = _data(10)
    ds = batches((x, y), 4, shuffle=True, seed=0)
    ys = np.concatenate([by for _, by in ds])
    assert len(ds) == 2 and len(ys) == 8 and len(np.unique(ys)) == 8
    ds = batches((x, y), 4, shuffle=True, seed=0, drop_remainder=False)
    assert [len(by) for _, by in ds] == [4, 4, 2]


def test_repeat_cycles_epochs():
    _, y = _data(10)
    out = list(itertools.islice(batches(y, 4, drop_remainder=False, repeat=True), 7))
    assert [b.tolist() for b in out] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9],
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9],
        [0, 1, 2, 3],
    ]  # fmt: skip
    out = list(itertools.islice(batches(y, 4, repeat=True), 4))
    assert [b.tolist() for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2


def test_repeat_shuffle_each_epoch_is_a_permutation():
    _, y = _data(12)
    it = iter(batches(y, 6, shuffle=True, seed=1, repeat=True))
    for _ in range(4):
        np.testing.assert_array_equal(np.sort(np.concatenate([next(it), next(it)])), y)


def test_repeat_has_no_len():
    _, y = _data()
    with pytest.raises(TypeError, match="repeat=True"):
        len(batches(y, 4, repeat=True))


def test_repeat_with_no_batches_raises():
    _, y = _data(3)
    with pytest.raises(ValueError, match="at least one batch"):
        batches(y, 4, repeat=True)


def test_length_mismatch_names_both():
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"arrays\[0\] has 10, arrays\[1\] has 9"):
        batches((x, y[:9]), 2)
    with pytest.raises(ValueError, match=r"arrays\['x'\] has 10, arrays\['y'\] has 8"):
        batches({"x": x, "y": y[:8]}, 2)


@pytest.mark.parametrize("size", [0, -1, 2.0, "4", None, True])
def test_bad_batch_size(size):
    x, _ = _data()
    with pytest.raises(ValueError, match=f"batch_size must be a positive int, got {size!r}"):
        batches(x, size)


def test_numpy_int_batch_size_ok():
    x, _ = _data()
    assert len(batches(x, np.int64(5))) == 2


def test_bad_structures():
    x, y = _data()
    with pytest.raises(TypeError, match="got a list"):
        batches([x, y], 2)
    with pytest.raises(TypeError, match="nested"):
        batches((x, (y, y)), 2)
    with pytest.raises(ValueError, match="scalar"):
        batches(np.float32(1.0), 2)
    with pytest.raises(ValueError, match="at least one array"):
        batches((), 2)


def test_load_digits_all():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


def test_load_digits_split():
    x, y = load_digits()
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    assert len(xtr) + len(xte) == 1797 and len(ytr) == len(xtr) and len(yte) == len(xte)
    assert abs(len(xte) - 0.2 * 1797) < 10
    for c in range(10):  # stratified: about 20% of each class is held out
        assert abs(np.sum(yte == c) - 0.2 * np.sum(y == c)) <= 1
    # every image is distinct, so rows identify examples: disjoint, and together all
    label_of = {r.tobytes(): int(c) for r, c in zip(x, y)}
    train = {r.tobytes(): int(c) for r, c in zip(xtr, ytr)}
    test = {r.tobytes(): int(c) for r, c in zip(xte, yte)}
    assert len(label_of) == 1797 and len(train) == len(xtr) and len(test) == len(xte)
    assert not train.keys() & test.keys()
    assert {**train, **test} == label_of  # features still paired with their labels
    # deterministic per seed, different across seeds
    np.testing.assert_array_equal(load_digits("test")[0], xte)
    assert {r.tobytes() for r in load_digits("test", seed=1)[0]} != test.keys()


def test_load_digits_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_digits("validation")
