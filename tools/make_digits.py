"""Build graphdist/datasets/digits.npz from scikit-learn's copy of the UCI digits.

Run once; the .npz is committed and scikit-learn is never a graphdist dependency.
How it was made (scikit-learn only in a throwaway venv):

    python3 -m venv /tmp/skl && /tmp/skl/bin/pip install scikit-learn
    /tmp/skl/bin/python tools/make_digits.py

The file holds `images` (uint8, values 0..16, shape (1797, 8, 8)) and `labels`
(int64, shape (1797,)), in scikit-learn's order. Origin and licence:
graphdist/datasets/LICENSE-digits.txt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parent.parent / "graphdist" / "datasets" / "digits.npz"


def main() -> None:
    bunch = load_digits()
    images = bunch.images.astype(np.uint8)  # (1797, 8, 8), counts of set pixels 0..16
    labels = bunch.target.astype(np.int64)  # (1797,)
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert np.array_equal(images, bunch.images) and images.max() == 16
    np.savez_compressed(OUT, images=images, labels=labels)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
