"""max_pool2d_grad's general kernel against its numpy form, bit for bit, where windows
overlap (three or more terms a position)."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.ops import OPS
from graphdist.runtime import kernel_table


@pytest.mark.parametrize("case", [((2, 9, 9, 3), (3, 3), (1, 1), "SAME"),
                                  ((2, 11, 10, 4), (3, 3), (2, 2), "VALID"),
                                  ((1, 8, 8, 2), (4, 2), (1, 2), "SAME")], ids=str)
def test_overlapping_windows_give_the_numpy_form_s_bits(case):
    """max_pool2d_grad's general kernel adds a position's terms in the numpy form's order
    (tap after tap): three or more windows routing to one position once summed in another
    order than the twin's, so a step's bits depended on which form ran."""
    shape, ksize, strides, padding = case
    p = {"ksize": ksize, "strides": strides, "padding": padding}
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2, shape).astype(np.float32)           # ties everywhere
    y = OPS["max_pool2d"].impl(np, x, **p)
    dy = (rng.standard_normal(y.shape) * 1e3).astype(np.float32)
    dx = np.full_like(x, 7)
    kernel_table.entry("cpu", "max_pool2d_grad").out(dx, x, y, dy, **p)
    np.testing.assert_array_equal(dx, OPS["max_pool2d_grad"].impl(np, x, y, dy, **p))
