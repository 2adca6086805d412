"""Run under `graphdist launch -n 2 [--restarts 1]`: Model.fit for 3 epochs of 22 rows in
batches of 8 (the last one partial) on MultiWorkerMirroredStrategy, with BackupAndRestore
every 2 batches into argv[2]. With argv[3] == "kill", worker 1 SIGKILLs itself after batch
1 of epoch 1 on the first attempt (GRAPHDIST_RESTART == "0"); the restarted job resumes
from the backup. The chief writes the final weights, the history, and evaluate's and
predict's results (every worker calls them) to argv[1]/final.npz,
to be compared with an uninterrupted run's (and, through compiled_model and fit, with the
same fit in one process on 2 devices)."""

import os
import signal
import sys

import numpy as np

import graphdist as gd

kill = False
rng = np.random.default_rng(0)
X = rng.normal(size=(22, 5)).astype(np.float32)
Y = rng.integers(0, 3, 22)
W1 = (rng.normal(size=(5, 6)) * 0.5).astype(np.float32)
W2 = (rng.normal(size=(6, 3)) * 0.5).astype(np.float32)


def compiled_model(strategy):
    """The model, compiled, and the data order's generator seeded, under `strategy`."""
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(6, activation="relu", kernel_initializer=W1),
                                  gd.nn.Dense(3, kernel_initializer=W2)])
        model.compile(gd.optimizers.SGD(0.2, momentum=0.9),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        gd.random.set_global_generator(gd.random.Generator(3))
    return model


def fit(model, callbacks=()):
    return model.fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=list(callbacks))


class KillWorkerOne(gd.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if kill and (self.epoch, batch) == (1, 1) and self.strategy.worker_index == 1 and \
                os.environ.get("GRAPHDIST_RESTART") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    gd.config.set_collective_timeout(20.0)
    out_dir, backup_dir = sys.argv[1], sys.argv[2]
    kill = len(sys.argv) > 3 and sys.argv[3] == "kill"
    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    model = compiled_model(strategy)
    history = fit(model, [gd.callbacks.BackupAndRestore(backup_dir, save_freq=2),
                          KillWorkerOne(strategy)])
    evaluated = model.evaluate(X, Y, batch_size=5)        # every worker takes part
    predicted = model.predict(X, batch_size=5)
    if strategy.is_chief:
        np.savez(os.path.join(out_dir, "final.npz"), *model.get_weights(),
                 attempt=int(os.environ.get("GRAPHDIST_RESTART", "-1")),
                 first_epoch=history.epoch[0], loss=np.array(history.history["loss"]),
                 evaluated=np.array(evaluated), predicted=predicted)
