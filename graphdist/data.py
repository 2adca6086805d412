"""Global batches over in-memory numpy arrays: `batches`, pure numpy.

Splitting a global batch across replicas lives in graphdist/distribute, not here.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["batches"]


class batches:
    """Iterate over global batches of an array, or of a tuple or dict of arrays.

    Each batch has the same structure as `arrays` and holds `batch_size` rows of
    every entry, taken along axis 0. With `shuffle=True` every epoch visits the
    examples in a fresh permutation drawn from `np.random.default_rng(seed)`; the
    generator lives on the object, so iterating the same object again is the next
    epoch and two objects built with the same seed give the same batches.
    `drop_remainder=False` also yields the last, smaller batch; `repeat=True`
    cycles epochs forever. `len()` is the number of batches per epoch (a TypeError
    when `repeat=True`). Unshuffled batches are read-only views of the inputs;
    shuffled batches are new arrays.

    >>> x, y = np.arange(10.0).reshape(5, 2), np.arange(5)
    >>> ds = batches((x, y), 2)
    >>> len(ds), [b[1].tolist() for b in ds]
    (2, [[0, 1], [2, 3]])
    """

    def __init__(
        self,
        arrays: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int | None = None,
        drop_remainder: bool = True,
        repeat: bool = False,
    ) -> None:
        if (
            not isinstance(batch_size, numbers.Integral)
            or isinstance(batch_size, bool)
            or batch_size <= 0
        ):
            raise ValueError(f"batches: batch_size must be a positive int, got {batch_size!r}")
        self._names, self._leaves = _flatten(arrays)
        self._structure = arrays
        self.num_examples = _common_length(self._names, self._leaves)
        self.batch_size = int(batch_size)
        self.shuffle, self.drop_remainder, self.repeat = bool(shuffle), drop_remainder, repeat
        self._rng = np.random.default_rng(seed) if shuffle else None
        if repeat and self._per_epoch() == 0:
            raise ValueError(
                f"batches: repeat=True needs at least one batch per epoch, got none "
                f"({self.num_examples} examples, batch_size={self.batch_size}, "
                f"drop_remainder={drop_remainder})"
            )

    def _per_epoch(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def __len__(self) -> int:
        if self.repeat:
            raise TypeError("batches: len() is undefined when repeat=True (it never ends)")
        return self._per_epoch()

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self._epoch()
            if not self.repeat:
                return

    def _epoch(self) -> Iterator[Any]:
        n, b = self.num_examples, self.batch_size
        order = self._rng.permutation(n) if self._rng is not None else None
        for i in range(self._per_epoch()):
            if order is None:
                rows = slice(i * b, min((i + 1) * b, n))
                yield self._rebuild([_read_only(a[rows]) for a in self._leaves])
            else:
                rows = order[i * b : (i + 1) * b]
                yield self._rebuild([np.take(a, rows, axis=0) for a in self._leaves])

    def _rebuild(self, leaves: list[np.ndarray]) -> Any:
        s = self._structure
        if isinstance(s, dict):
            return dict(zip(s.keys(), leaves))
        if isinstance(s, tuple):
            return type(s)(*leaves) if hasattr(s, "_fields") else tuple(leaves)
        return leaves[0]

    def __repr__(self) -> str:
        return (
            f"batches(<{self.num_examples} examples>, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, drop_remainder={self.drop_remainder}, "
            f"repeat={self.repeat})"
        )


def _flatten(arrays: Any) -> tuple[list[str], list[np.ndarray]]:
    if isinstance(arrays, dict):
        names, values = [f"arrays[{k!r}]" for k in arrays], list(arrays.values())
    elif isinstance(arrays, tuple):
        names, values = [f"arrays[{i}]" for i in range(len(arrays))], list(arrays)
    elif isinstance(arrays, list):
        raise TypeError(
            "batches: expected a numpy array or a tuple or dict of them, got a list; "
            "hint: pass a tuple, e.g. batches((x, y), batch_size)"
        )
    else:
        names, values = ["arrays"], [arrays]
    if not values:
        raise ValueError(
            f"batches: expected at least one array, got an empty {type(arrays).__name__}"
        )
    leaves = []
    for name, v in zip(names, values):
        if isinstance(v, (tuple, dict)):
            raise TypeError(
                f"batches: {name} is a {type(v).__name__}; nested structures are not supported"
            )
        a = np.asarray(v)
        if a.ndim == 0:
            raise ValueError(f"batches: {name} needs at least one axis to batch over, got a scalar")
        leaves.append(a)
    return names, leaves


def _common_length(names: list[str], leaves: list[np.ndarray]) -> int:
    n = len(leaves[0])
    for name, a in zip(names[1:], leaves[1:]):
        if len(a) != n:
            raise ValueError(
                f"batches: all arrays need the same length on axis 0: {names[0]} has {n}, "
                f"{name} has {len(a)}"
            )
    return n


def _read_only(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.flags.writeable = False
    return a
