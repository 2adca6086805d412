"""gd.scan over 1,000 steps: compile time at 10 / 1,000 / 10,000 steps (independent of the
trip count) and the per-iteration time of a small RNN cell against a hand-written numpy
loop doing the same ops (target: within 1.5x).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/scan_overhead.py
"""

import time

import numpy as np

import graphdist as gd


def cell_np(h, x, w, u):
    return np.tanh(x @ w + h @ u)


def numpy_loop(h, xs, w, u):
    ys = np.empty((len(xs),) + h.shape, h.dtype)
    for i in range(len(xs)):
        h = cell_np(h, xs[i], w, u)
        ys[i] = h
    return h, ys


@gd.function
def scanned(h, xs, w, u):
    return gd.scan(lambda h, x: (gd.tanh(x @ w + h @ u), gd.tanh(x @ w + h @ u)), h, xs)


def best(fn, *args, repeat=5):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main(width=32, batch=8):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(width, width)).astype(np.float32) * 0.1
    u = rng.normal(size=(width, width)).astype(np.float32) * 0.1
    h = np.zeros((batch, width), np.float32)
    for steps in (10, 1000, 10000):
        xs = rng.normal(size=(steps, batch, width)).astype(np.float32)
        start = time.perf_counter()
        scanned(h, xs, w, u)
        print(f"steps {steps:6d}: first call (trace + compile + run) "
              f"{(time.perf_counter() - start) * 1e3:7.1f} ms")
    xs = rng.normal(size=(1000, batch, width)).astype(np.float32)
    got, ref = scanned(h, xs, w, u), numpy_loop(h, xs, w, u)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-5)
    t_gd, t_np = best(scanned, h, xs, w, u), best(numpy_loop, h, xs, w, u)
    print(f"1000 steps: gd.scan {t_gd * 1e3:.2f} ms ({t_gd * 1e3:.2f} us/step), numpy loop "
          f"{t_np * 1e3:.2f} ms: ratio {t_gd / t_np:.2f}x")


if __name__ == "__main__":
    main()
