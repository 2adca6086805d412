"""experimental_distribute_dataset(iterable, prefetch=k, per_replica_batch=...) (docs/api.md
"Multi-step loops and input prefetch"): the prefetch thread gives the same batches as no
prefetch, reads at most k steps ahead, hands the input's errors to the step that needed
them, and always ends; per_replica_batch groups replicas' batches as TF's contrib
PerDeviceDataset did."""

from __future__ import annotations

import gc
import threading
import traceback
import weakref
from collections import namedtuple

import numpy as np
import pytest

import graphdist as gd

FOUR = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
WAIT = 10.0          # bound on every wait for the prefetch thread (a correct one needs ~0)


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "graphdist-prefetch"]


@pytest.fixture(autouse=True)
def _no_thread_left():
    assert _threads() == []
    yield
    left = _threads()
    for t in left:
        t.join(WAIT)
    assert left == [], "a prefetch thread outlived its test"


@pytest.fixture
def strategy():
    return gd.MirroredStrategy(list(FOUR))


class Boom(Exception):
    pass


class Source:
    """An iterable of `batches` that counts how far its reader got ahead of the consumer
    (`requested` is bumped by the test before each next()) and raises Boom at `fail_at`."""

    def __init__(self, batches, fail_at=None, per_step=1):
        self.batches, self.fail_at, self.per_step = list(batches), fail_at, per_step
        self.pulled = self.requested = self.max_ahead = 0
        self.cond = threading.Condition()
        self.failed = threading.Event()

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            with self.cond:
                self.pulled += 1
                self.max_ahead = max(self.max_ahead, self.pulled - self.requested)
                self.cond.notify_all()
            if i == self.fail_at:
                self.failed.set()
                raise Boom(f"batch {i} is corrupt")
            yield batch

    def next(self, it):
        with self.cond:
            self.requested += self.per_step
        return next(it)

    def wait_pulled(self, count) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.pulled >= count, timeout=WAIT)


def _data(rows=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    return x, x @ np.array([[1, -1], [2, 0], [0, 3]], np.float32)     # learnable targets


def _leaves(batch) -> list:
    if isinstance(batch, dict):
        return [leaf for k in sorted(batch) for leaf in _leaves(batch[k])]
    if isinstance(batch, (tuple, list)):
        return [leaf for b in batch for leaf in _leaves(b)]
    return [batch]


def _assert_same_steps(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert type(g) is type(w)
        for a, b in zip(_leaves(g), _leaves(w), strict=True):
            assert isinstance(a, gd.PerReplica) and a.devices == b.devices == FOUR
            for u, v in zip(a.values, b.values, strict=True):
                assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)


# ---------------------------------------------------------------- same batches


@pytest.mark.parametrize("k", [1, 2, 5])
def test_prefetch_gives_the_same_batches_in_order(strategy, k):
    x, y = _data(42)
    makers = [lambda: gd.data.batches((x, y), 8, drop_remainder=False),   # last batch: 2 rows
              lambda: gd.data.batches({"x": x, "y": y}, 10, shuffle=True, seed=3),
              lambda: [x[:5], x[5:13], x[13:14]]]                       # uneven, one empty
    for make in makers:
        want = list(strategy.experimental_distribute_dataset(make()))
        got = list(strategy.experimental_distribute_dataset(make(), prefetch=k))
        _assert_same_steps(got, want)


def test_cpu_shards_are_not_copied(strategy):
    # host devices: the prefetched shards are the views of the input that prefetch=0 gives
    x, _ = _data(16)
    for step in strategy.experimental_distribute_dataset(gd.data.batches(x, 8), prefetch=2):
        assert all(isinstance(v, np.ndarray) and np.shares_memory(v, x) for v in step.values)


def test_one_replica_prefetch_yields_the_batches_themselves():
    x, _ = _data(12)
    one = gd.OneDeviceStrategy("cpu:0")
    got = list(one.experimental_distribute_dataset(gd.data.batches(x, 4), prefetch=2))
    assert len(got) == 3 and not any(isinstance(b, gd.PerReplica) for b in got)
    for i, b in enumerate(got):
        assert np.shares_memory(b, x) and np.array_equal(b, x[4 * i:4 * i + 4])


def _train(prefetch, source, steps=None):
    strategy = gd.MirroredStrategy(list(FOUR))
    with strategy.scope():
        w = gd.Variable(np.zeros((3, 2), np.float32), name="w")
        opt = gd.optimizers.SGD(learning_rate=0.1, momentum=0.9)

    @gd.function
    def train_step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.square(x @ w - y))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch), axis=None)

    losses, weights, error = [], [], None
    try:
        for batch in strategy.experimental_distribute_dataset(source, prefetch=prefetch):
            losses.append(train_step(batch))
            weights.append(w.numpy().copy())
    except Boom as e:
        error = e
    return np.array(losses), weights, w.numpy(), error


def test_training_is_bit_identical_with_prefetch():
    x, y = _data(40)
    losses0, _, w0, _ = _train(0, gd.data.batches((x, y), 8))
    losses2, _, w2, _ = _train(2, gd.data.batches((x, y), 8))
    assert len(losses0) == 5 and losses0[-1] < losses0[0]
    assert losses0.tobytes() == losses2.tobytes() and w0.tobytes() == w2.tobytes()


# ---------------------------------------------------------------- read-ahead bound


@pytest.mark.parametrize("k, per_replica_batch", [(1, False), (3, False), (2, True)])
def test_reads_at_most_k_steps_ahead(strategy, k, per_replica_batch):
    x, _ = _data(48)
    per_step = 4 if per_replica_batch else 1      # source batches per step
    source = Source(np.split(x, 12), per_step=per_step)     # 12 batches of 4 rows
    dist = strategy.experimental_distribute_dataset(source, prefetch=k,
                                                    per_replica_batch=per_replica_batch)
    it = iter(dist)
    # before any next(), the thread stages exactly k steps, and no more
    assert source.wait_pulled(k * per_step)
    for step in range(12 // per_step):
        source.next(it)
        # the thread refills to k steps ahead of the consumer (or to the end of the input)
        assert source.wait_pulled(min(12, (step + 1 + k) * per_step))
    with pytest.raises(StopIteration):
        source.next(it)
    assert source.max_ahead == k * per_step
    assert _threads() == []


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("k", [0, 2])
def test_input_error_surfaces_on_the_step_that_needed_it(strategy, k):
    x, _ = _data(20)
    source = Source(np.split(x, 5), fail_at=3)
    it = iter(strategy.experimental_distribute_dataset(source, prefetch=k))
    good = [source.next(it) for _ in range(2)]
    if k:                            # the thread has met the error, yet the good batch comes
        assert source.failed.wait(WAIT)
    good.append(source.next(it))
    assert [np.concatenate(b.values).tolist() for b in good] == [b.tolist() for b in
                                                                 np.split(x, 5)[:3]]
    with pytest.raises(Boom, match="batch 3 is corrupt") as info:
        source.next(it)
    # the input's own exception, with the input's frame in its traceback
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "__iter__" and f.filename == __file__ for f in frames)
    for _ in range(2):               # the pass is over: StopIteration, consistently
        with pytest.raises(StopIteration):
            next(it)
    assert _threads() == []


@pytest.mark.parametrize("k", [0, 1])
def test_split_error_surfaces_on_its_step(strategy, k):
    it = iter(strategy.experimental_distribute_dataset(
        [np.ones(4), np.float32(1.0), np.ones(4)], prefetch=k))
    assert len(next(it).values) == 4
    with pytest.raises(ValueError, match="cannot split a scalar"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_failed_step_leaves_variables_at_the_last_completed_step():
    x, y = _data(40)
    batches = list(gd.data.batches((x, y), 8))
    clean_losses, clean_weights, _, _ = _train(0, batches[:3])
    losses, weights, w, error = _train(2, Source(batches, fail_at=3))
    assert isinstance(error, Boom) and str(error) == "batch 3 is corrupt"
    assert losses.tobytes() == clean_losses.tobytes() and len(weights) == 3
    assert w.tobytes() == clean_weights[-1].tobytes()


# ---------------------------------------------------------------- the thread ends


def test_thread_ends_with_the_input(strategy):
    dist = strategy.experimental_distribute_dataset([np.ones(4)] * 3, prefetch=2)
    it = iter(dist)
    assert len(_threads()) == 1
    assert len(list(it)) == 3
    assert _threads() == []


def test_thread_ends_on_close(strategy):
    forever = gd.data.batches(np.arange(8.0), 4, repeat=True)
    it = iter(strategy.experimental_distribute_dataset(forever, prefetch=2))
    next(it)
    assert len(_threads()) == 1
    it.close()
    assert _threads() == []
    with pytest.raises(StopIteration):
        next(it)


def test_dataset_close_and_with_end_every_pass(strategy):
    forever = gd.data.batches(np.arange(8.0), 4, repeat=True)
    with strategy.experimental_distribute_dataset(forever, prefetch=1) as dist:
        a, b = iter(dist), iter(dist)            # each iter() is a pass with its own thread
        next(a), next(b), next(b)
        assert len(_threads()) == 2
    assert _threads() == []
    it = iter(dist)                              # a closed dataset can start a new pass
    assert next(it).values[0].tolist() == [0.0]
    with it:
        pass
    assert _threads() == []


def test_thread_ends_when_a_half_consumed_iterator_is_collected(strategy):
    forever = gd.data.batches(np.arange(8.0), 4, repeat=True)
    dist = strategy.experimental_distribute_dataset(forever, prefetch=2)
    it = iter(dist)
    next(it)
    assert len(_threads()) == 1
    ref = weakref.ref(it)
    del it
    gc.collect()
    assert ref() is None                         # the thread did not keep it alive
    assert _threads() == []


def test_thread_ends_after_break(strategy):
    forever = gd.data.batches(np.arange(8.0), 4, repeat=True)
    for i, _ in enumerate(strategy.experimental_distribute_dataset(forever, prefetch=3)):
        if i == 2:
            break
    gc.collect()
    assert _threads() == []


def test_each_iter_is_a_fresh_pass(strategy):
    dist = strategy.experimental_distribute_dataset(gd.data.batches(np.arange(8.0), 4),
                                                    prefetch=1)
    first = [np.concatenate(b.values).tolist() for b in dist]
    second = [np.concatenate(b.values).tolist() for b in dist]
    assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---------------------------------------------------------------- per_replica_batch


@pytest.mark.parametrize("k", [0, 2])
def test_per_replica_batch_groups_consecutive_batches(strategy, k):
    # 9 batches of different sizes: two steps of 4 replicas; the 9th (an incomplete group)
    # is dropped, as TF's contrib PerDeviceDataset's batch(len(devices), drop_remainder=True)
    batches = [(np.full((i % 3 + 1, 2), i, np.float32), np.full(i % 3 + 1, i, np.int32))
               for i in range(9)]
    dist = strategy.experimental_distribute_dataset(batches, prefetch=k,
                                                    per_replica_batch=True)
    assert len(dist) == 2
    steps = list(dist)
    assert len(steps) == 2
    for s, (bx, by) in enumerate(steps):
        assert bx.devices == by.devices == FOUR
        for r in range(4):
            assert np.array_equal(bx.values[r], batches[4 * s + r][0])
            assert np.array_equal(by.values[r], batches[4 * s + r][1])
    # uneven per-replica shapes run through strategy.run
    out = strategy.run(lambda a, b: gd.reduce_sum(a), args=steps[1])
    assert [float(v) for v in out.values] == [i * (i % 3 + 1) * 2 for i in range(4, 8)]


def test_per_replica_batch_dicts_and_namedtuples(strategy):
    batches = [{"b": np.full(2, i), "a": np.full(1, -i)} for i in range(4)]
    (step,) = strategy.experimental_distribute_dataset(batches, per_replica_batch=True)
    assert list(step) == ["b", "a"]
    assert [int(v[0]) for v in step["a"].values] == [0, -1, -2, -3]
    Pair = namedtuple("Pair", "x y")
    batches = [Pair(np.full(i + 1, i), np.arange(i + 1)) for i in range(8)]
    steps = list(strategy.experimental_distribute_dataset(batches, prefetch=1,
                                                          per_replica_batch=True))
    assert [type(s) for s in steps] == [Pair, Pair]
    assert [len(v) for v in steps[1].y.values] == [5, 6, 7, 8]
    assert [int(v[0]) for v in steps[1].x.values] == [4, 5, 6, 7]


@pytest.mark.parametrize("k", [0, 1])
def test_per_replica_batch_structure_mismatch(strategy, k):
    batches = [(np.ones(2), np.ones(2))] * 3 + [np.ones(2)] + [(np.ones(2), np.ones(2))] * 4
    it = iter(strategy.experimental_distribute_dataset(batches, prefetch=k,
                                                       per_replica_batch=True))
    with pytest.raises(ValueError, match=r"per_replica_batch=True.*replica 3's is a leaf"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_per_replica_batch_one_replica_is_the_batches():
    one = gd.OneDeviceStrategy("cpu:0")
    batches = [np.arange(3.0), np.arange(2.0)]
    got = list(one.experimental_distribute_dataset(batches, per_replica_batch=True))
    assert len(got) == 2 and got[0] is batches[0]


# ---------------------------------------------------------------- arguments and len


@pytest.mark.parametrize("prefetch, error", [(-1, ValueError), (1.5, TypeError),
                                             ("2", TypeError), (True, TypeError),
                                             (None, TypeError)])
def test_bad_prefetch(strategy, prefetch, error):
    with pytest.raises(error, match="prefetch must be an int >= 0"):
        strategy.experimental_distribute_dataset([np.ones(4)], prefetch=prefetch)
    assert _threads() == []


def test_bad_per_replica_batch_and_iterable(strategy):
    with pytest.raises(TypeError, match="per_replica_batch must be True or False"):
        strategy.experimental_distribute_dataset([np.ones(4)], per_replica_batch="yes")
    with pytest.raises(TypeError, match="expected an iterable of batches, got int"):
        strategy.experimental_distribute_dataset(5, prefetch=1)
    assert len(list(strategy.experimental_distribute_dataset([np.ones(4)],
                                                             prefetch=np.int64(1)))) == 1


def test_len(strategy):
    assert len(strategy.experimental_distribute_dataset([np.ones(4)] * 9, prefetch=2)) == 9
    assert len(strategy.experimental_distribute_dataset([np.ones(4)] * 9,
                                                        per_replica_batch=True)) == 2
    with pytest.raises(TypeError):
        len(strategy.experimental_distribute_dataset(np.ones(4) for _ in range(3)))


# ---------------------------------------------------------------- device placement


class _Placed:
    def __init__(self, device, array):
        self.device, self.array, self.thread = device, array, threading.current_thread().name


class _FakeGpu:
    """A device backend that is not the host's: to_device records where and on which
    thread each shard was placed."""

    xp = object()

    def __init__(self, device):
        self.device = device

    def to_device(self, value):
        return _Placed(self.device, value)


def test_shards_are_placed_on_their_devices_by_the_thread(strategy, monkeypatch):
    from graphdist.distribute import prefetch

    monkeypatch.setattr(prefetch, "backend_for", _FakeGpu)
    x, y = _data(16)
    for prefetch_k, expect_placed in [(0, False), (2, True)]:
        steps = list(strategy.experimental_distribute_dataset(gd.data.batches((x, y), 8),
                                                              prefetch=prefetch_k))
        assert len(steps) == 2
        for s, (bx, by) in enumerate(steps):
            assert bx.devices == FOUR
            if not expect_placed:        # prefetch=0: the step copies its arguments itself
                assert all(isinstance(v, np.ndarray) for v in bx.values)
                continue
            for leaf, full in [(bx, x), (by, y)]:
                assert [v.device for v in leaf.values] == list(FOUR)
                assert {v.thread for v in leaf.values} == {"graphdist-prefetch"}
                np.testing.assert_array_equal(np.concatenate([v.array for v in leaf.values]),
                                              full[8 * s:8 * s + 8])
