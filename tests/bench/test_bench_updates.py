"""bench/adam_fused.py's unfused numpy contenders do the update graphdist's optimizers do
(so its table compares the same work), checked on small tensors over three steps."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from bench import adam_fused as bench


@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_numpy_contenders_match_the_optimizers(name):
    rng = np.random.default_rng(1)
    params = [rng.standard_normal(n).astype(np.float32) for n in (5, 300)]
    grads = [rng.standard_normal(n).astype(np.float32) for n in (5, 300)]
    variables = [gd.Variable(p.copy()) for p in params]
    zeros = lambda: [np.zeros_like(p) for p in params]
    mine = [p.copy() for p in params]
    if name == "adam":
        opt = gd.optimizers.Adam(bench.LR, bench.B1, bench.B2, bench.EPS)
        step = bench.numpy_adam(mine, grads, zeros(), zeros(), zeros())
    else:
        opt = gd.optimizers.SGD(bench.LR, momentum=bench.MOMENTUM)
        step = bench.numpy_momentum(mine, grads, zeros(), zeros())
    update = gd.function(lambda gs: opt.apply_gradients(zip(gs, variables)))
    for _ in range(3):
        update(grads)
        step()
    for v, p, p0 in zip(variables, mine, params):
        assert not np.allclose(p, p0)
        np.testing.assert_allclose(v.numpy(), p, rtol=1e-6, atol=1e-7)
