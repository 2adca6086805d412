"""Small bundled datasets, loaded as numpy arrays; no downloads, no extra dependencies.

The UCI handwritten digits (see LICENSE-digits.txt) and about 60 KB of Shakespeare for
character-level language models (LICENSE-shakespeare.txt). Batching lives in
graphdist/data.py.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_digits", "load_shakespeare"]


def load_digits(
    split: str | None = None, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Return the 1,797 UCI 8x8 digits as float32 features in [0, 1] and int32 labels.

    `split="train"` or `"test"` gives a seeded split, stratified by class, with
    about `test_fraction` of each class in the test part; `split=None` gives all.

    >>> x, y = load_digits()
    >>> x.shape, x.dtype, y.shape, y.dtype
    ((1797, 64), dtype('float32'), (1797,), dtype('int32'))
    >>> len(load_digits("train")[0]) + len(load_digits("test")[0])
    1797
    """
    if split not in (None, "train", "test"):
        raise ValueError(f"load_digits: split must be None, 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction must be in (0, 1), got {test_fraction}")
    with resources.files(__name__).joinpath("digits.npz").open("rb") as f, np.load(f) as data:
        images, labels = data["images"], data["labels"]
    x = images.reshape(len(images), 64).astype(np.float32) / np.float32(16.0)  # (1797, 64)
    y = labels.astype(np.int32)  # (1797,)
    if split is None:
        return x, y
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test.append(idx[: round(test_fraction * len(idx))])
    is_test = np.zeros(len(y), dtype=bool)
    is_test[np.concatenate(test)] = True
    keep = is_test if split == "test" else ~is_test
    # one more seeded shuffle so classes are interleaved, not grouped
    order = rng.permutation(np.flatnonzero(keep))
    return x[order], y[order]


def load_shakespeare(split: str | None = None, test_fraction: float = 0.1) -> str:
    """Return the bundled public-domain text (the opening of Shakespeare's Coriolanus,
    59,804 characters, 59 distinct) as a str.

    `split="train"` gives the first 1 - `test_fraction` of it, `"test"` the rest (a cut
    by position, as character models hold out the end of the text); `split=None` all.

    >>> text = load_shakespeare()
    >>> len(text), text[:14]
    (59804, 'First Citizen:')
    >>> len(load_shakespeare("train")) + len(load_shakespeare("test"))
    59804
    """
    if split not in (None, "train", "test"):
        raise ValueError(f"load_shakespeare: split must be None, 'train' or 'test', got "
                         f"{split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_shakespeare: test_fraction must be in (0, 1), got "
                         f"{test_fraction}")
    text = resources.files(__name__).joinpath("shakespeare.txt").read_text(encoding="utf-8")
    if split is None:
        return text
    cut = round(len(text) * (1 - test_fraction))
    return text[:cut] if split == "train" else text[cut:]
