"""Model.fit, evaluate, predict and the metrics on 2 logical GPUs against the same fit on 2
logical CPUs (a machine with a GPU runs it: python3 tools/gpu_fit_check.py). Prints one
line per check and exits non-zero on the first failure."""

import sys

import numpy as np

import graphdist as gd

rng = np.random.default_rng(3)
X = rng.normal(size=(22, 5)).astype(np.float32)
Y = rng.integers(0, 3, 22)
W1 = (rng.normal(size=(5, 6)) * 0.5).astype(np.float32)
W2 = (rng.normal(size=(6, 3)) * 0.5).astype(np.float32)


def fitted(kind):
    strategy = gd.MirroredStrategy([f"{kind}:0", f"{kind}:1"])
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(6, activation="relu", kernel_initializer=W1),
                                  gd.nn.Dense(3, kernel_initializer=W2)])
        model.compile(gd.optimizers.SGD(0.2, momentum=0.9),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=2)
        auc = gd.metrics.AUC()
    history = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    batch = next(iter(strategy.experimental_distribute_dataset([(Y == 1, X[:, 0] > 0)])))
    strategy.run(auc.update_state, args=batch)
    return model, history, float(auc.result())


def main() -> int:
    gd.config.set_logical_device_count("gpu", 2)
    gpu, gpu_history, gpu_auc = fitted("gpu")
    cpu, cpu_history, cpu_auc = fitted("cpu")
    checks = {
        "weights": all(np.allclose(a, b, rtol=1e-4, atol=1e-5)
                       for a, b in zip(gpu.get_weights(), cpu.get_weights())),
        "history": np.allclose(gpu_history.history["loss"], cpu_history.history["loss"],
                               rtol=1e-5),
        "evaluate": np.allclose(gpu.evaluate(X, Y, batch_size=5), cpu.evaluate(X, Y, batch_size=5),
                                rtol=1e-4),
        "predict": np.allclose(gpu.predict(X, batch_size=3), cpu.predict(X, batch_size=3),
                               rtol=1e-4, atol=1e-5),
        "auc": abs(gpu_auc - cpu_auc) < 1e-6,
    }
    for name, ok in checks.items():
        print(f"gpu_fit_check {name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
