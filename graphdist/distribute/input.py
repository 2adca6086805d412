"""Splitting global batches into per-replica shards, grouping per-replica batches, and the
distributed dataset and iterator that experimental_distribute_dataset returns (the
background thread of prefetch=k lives in prefetch.py)."""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Iterator

import numpy as np

from graphdist.device.backends import is_device_array
from graphdist.distribute.prefetch import Prefetcher, placer
from graphdist.distribute.values import LocalValue, PerReplica, map_structure


def shard_sizes(n_rows: int, n: int) -> list[int]:
    """Near-equal shard sizes; the first shards get one extra row (10 on 4 -> 3, 3, 2, 2)."""
    base, extra = divmod(n_rows, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split_array(a, n: int) -> PerReplica:
    a = np.asarray(a)
    if a.ndim == 0:
        raise ValueError(f"cannot split a scalar across {n} replicas; batches need axis 0")
    bounds = np.cumsum([0] + shard_sizes(a.shape[0], n))
    return PerReplica(tuple(a[bounds[i]:bounds[i + 1]] for i in range(n)))


def distribute_batch(batch, n: int):
    """The same structure as `batch` with every array replaced by a PerReplica of shards."""
    return map_structure(lambda v: v if isinstance(v, PerReplica) else split_array(v, n), batch)


def group_batches(batches, n: int):
    """`n` batches, one per replica (replica k gets batches[k]), as one batch of the same
    structure whose leaves are PerReplica. Shapes may differ between replicas; the
    structure (tuple, list, namedtuple, dict keys) may not.

    >>> step = group_batches([np.zeros(2), np.ones(3)], 2)
    >>> [v.shape for v in step.values]
    [(2,), (3,)]
    """
    assert len(batches) == n, (len(batches), n)
    return _zip_replicas(list(batches), "")


def _node(x):
    if isinstance(x, PerReplica):
        return None
    if isinstance(x, dict):
        return dict, frozenset(x)
    if isinstance(x, (tuple, list)):
        return type(x), len(x)
    return None


def _describe(x) -> str:
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(repr, x))}"
    if isinstance(x, (tuple, list)) and not isinstance(x, PerReplica):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a leaf ({type(x).__name__})"


def _zip_replicas(parts: list, path: str):
    first = parts[0]
    for k, part in enumerate(parts[1:], 1):
        if _node(part) != _node(first):
            raise ValueError(
                f"experimental_distribute_dataset(per_replica_batch=True): the batches of one "
                f"step differ in structure at batch{path}: replica 0's is {_describe(first)}, "
                f"replica {k}'s is {_describe(part)}; every replica's batch needs the same "
                "structure (shapes may differ)")
    if isinstance(first, dict):
        return {key: _zip_replicas([p[key] for p in parts], f"{path}[{key!r}]")
                for key in first}
    if isinstance(first, (tuple, list)) and not isinstance(first, PerReplica):
        items = [_zip_replicas([p[i] for p in parts], f"{path}[{i}]")
                 for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if any(isinstance(p, PerReplica) for p in parts):
        raise TypeError(f"experimental_distribute_dataset(per_replica_batch=True): batch{path} "
                        "is already a gd.PerReplica; each incoming batch is one replica's")
    return PerReplica(tuple(p if is_device_array(p) else np.asarray(p) for p in parts))


def _groups(batches: Iterator, n: int) -> Iterator[list]:
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == n:
            yield group
            group = []
    # an incomplete last group is dropped, as TF's contrib PerDeviceDataset did with
    # dataset.batch(len(devices), drop_remainder=True)


def _tagged(batch, devices):
    def tag(v):
        if isinstance(v, PerReplica) and not isinstance(v, LocalValue) and v.devices is None \
                and len(v.values) == len(devices):
            v.devices = tuple(devices)
        return v

    return map_structure(tag, batch)


def _steps(batches: Iterator, n: int, devices, per_replica_batch: bool, place,
           first: int = 0) -> Iterator:
    """One pass: each step's batch, split (or grouped), tagged with its devices, placed.
    This process's replicas are `devices`, global replicas first, first + 1, ... of n
    (all of them but under a multi-worker strategy, where every worker reads the same global
    batches and keeps its replicas' shards, as TF's auto-shard by data does)."""
    if per_replica_batch and n > 1:
        batches = _groups(batches, n)
    for batch in batches:
        if n > 1:
            batch = group_batches(batch, n) if per_replica_batch else distribute_batch(batch, n)
            if len(devices) < n:
                batch = map_structure(lambda v: PerReplica(v.values[first:first + len(devices)])
                                      if isinstance(v, PerReplica) else v, batch)
            batch = _tagged(batch, devices)
        yield batch if place is None else place(batch)


class DistributedDataset:
    """What `strategy.experimental_distribute_dataset(iterable, prefetch=0,
    per_replica_batch=False)` returns. Each `iter()` starts a fresh pass over `iterable`
    (a DistributedIterator), with its own prefetch thread when `prefetch` > 0; `len()` is
    the number of steps when `iterable` has a length. `close()` (or leaving a `with`
    block) ends the passes in progress; a later `iter()` starts a new one.

    >>> strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.experimental_distribute_dataset([np.arange(4.0)], prefetch=1) as dist:
    ...     [v.tolist() for v in next(iter(dist)).values]
    [[0.0, 1.0], [2.0, 3.0]]
    """

    def __init__(self, iterable, n: int, devices, prefetch: int = 0,
                 per_replica_batch: bool = False, first: int = 0):
        where = "experimental_distribute_dataset"
        if not (hasattr(type(iterable), "__iter__") or hasattr(type(iterable), "__getitem__")):
            raise TypeError(f"{where}: expected an iterable of batches, got "
                            f"{type(iterable).__name__}")
        if not isinstance(prefetch, numbers.Integral) or isinstance(prefetch, (bool, np.bool_)):
            raise TypeError(f"{where}: prefetch must be an int >= 0 (the number of batches "
                            f"staged ahead), got {prefetch!r}")
        if prefetch < 0:
            raise ValueError(f"{where}: prefetch must be an int >= 0 (the number of batches "
                             f"staged ahead), got {prefetch!r}")
        if not isinstance(per_replica_batch, (bool, np.bool_)):
            raise TypeError(f"{where}: per_replica_batch must be True or False, got "
                            f"{per_replica_batch!r}")
        self.iterable = iterable
        self.n = n
        self.devices = tuple(devices)
        self.prefetch = int(prefetch)
        self.per_replica_batch = bool(per_replica_batch)
        self._passes: weakref.WeakSet = weakref.WeakSet()
        self.first = first          # this process's first global replica (multi-worker)

    def __iter__(self) -> DistributedIterator:
        place = None
        if self.prefetch and len(self.devices) > 1:
            place = placer(self.devices)
        steps = _steps(iter(self.iterable), self.n, self.devices, self.per_replica_batch, place,
                       self.first)
        it = DistributedIterator(steps, self.prefetch)
        self._passes.add(it)
        return it

    def __len__(self) -> int:
        batches = len(self.iterable)
        return batches // self.n if self.per_replica_batch else batches

    def close(self) -> None:
        """End every pass in progress (their prefetch threads stop)."""
        for it in list(self._passes):
            it.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DistributedDataset({self.iterable!r}, replicas={self.n}, "
                f"prefetch={self.prefetch}, per_replica_batch={self.per_replica_batch})")


class DistributedIterator:
    """One pass over a distributed dataset: `next()` gives the next step's batch. An error
    of the input (or of splitting it) is raised, with its own type, by the `next()` whose
    batch needed it; the pass is then over, and later calls raise StopIteration, as a
    Python generator does after raising. `close()` (or a `with` block, or dropping the
    iterator) stops its prefetch thread."""

    def __init__(self, steps: Iterator, prefetch: int = 0):
        self._steps = None if prefetch else steps
        self._prefetcher = Prefetcher(steps, prefetch) if prefetch else None
        self._done = False

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            if self._prefetcher is not None:
                return self._prefetcher.get()
            return next(self._steps)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End this pass; the prefetch thread, if any, is stopped and joined (bounded)."""
        self._done = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        elif self._steps is not None:
            self._steps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
