"""gd.callbacks: the hooks fit calls and each callback's behaviour. Monitored values are
scripted by a callback listed first (fit hands every callback the same logs), so each rule
(patience, best-only, plateaus) is checked on known numbers. BackupAndRestore: a fit that
an exception stops part-way resumes from the backup and ends with the same weights, bit for
bit, as an uninterrupted fit."""

import csv
import importlib.util
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import graphdist as gd
from mpi_launch import SCRIPTS, needs_mpi

FIT_RESTART = os.path.join(SCRIPTS, "fit_restart.py")
needs_safetensors = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                       reason="the safetensors extra is not installed")
needs_tensorboardx = pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None,
                                        reason="the tensorboard extra is not installed")
rng = np.random.default_rng(5)
N, D, C = 24, 4, 3
X = rng.normal(size=(N, D)).astype(np.float32)
Y = rng.integers(0, C, N)
W1 = (rng.normal(size=(D, 8)) * 0.5).astype(np.float32)
W2 = (rng.normal(size=(8, C)) * 0.5).astype(np.float32)


def _model(n=2, lr=0.1, optimizer=None):
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(8, activation="relu", kernel_initializer=W1),
                                  gd.nn.Dense(C, kernel_initializer=W2)])
        model.compile(optimizer or gd.optimizers.Adam(lr),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


class Script(gd.callbacks.Callback):
    """Puts scripted[epoch] into the epoch's logs under `key` and keeps each epoch's
    weights."""

    def __init__(self, key, values):
        super().__init__()
        self.key, self.values, self.weights = key, values, []

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = float(self.values[epoch])
        self.weights.append(self.model.get_weights())


class Record(gd.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            calls = object.__getattribute__(self, "calls")
            return lambda *args: calls.append((name,) + tuple(a for a in args
                                                              if isinstance(a, int)))
        return object.__getattribute__(self, name)


def test_hooks_in_keras_order():
    record = Record()
    _model().fit(X, Y, batch_size=12, epochs=2, verbose=0, callbacks=[record],
                 validation_data=(X[:5], Y[:5]))
    epoch = lambda e: [("on_epoch_begin", e), ("on_train_batch_begin", 0),   # noqa: E731
                       ("on_train_batch_end", 0), ("on_train_batch_begin", 1),
                       ("on_train_batch_end", 1), ("on_test_begin",),
                       ("on_test_batch_begin", 0), ("on_test_batch_end", 0), ("on_test_end",),
                       ("on_epoch_end", e)]
    assert record.calls == [("on_train_begin",)] + epoch(0) + epoch(1) + [("on_train_end",)]


def test_batch_logs_are_running_values():
    seen = []

    class Batches(gd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    history = _model().fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[Batches()])
    assert [sorted(s) for s in seen] == [["accuracy", "loss"]] * 3
    assert seen[-1]["loss"] == history.history["loss"][0]


@needs_safetensors
def test_model_checkpoint_formats_the_path_and_saves_best_only(tmp_path):
    scores = [3.0, 1.0, 2.0, 0.5]
    script = Script("score", scores)
    every = gd.callbacks.ModelCheckpoint(str(tmp_path / "all-{epoch:02d}.safetensors"))
    best = gd.callbacks.ModelCheckpoint(str(tmp_path / "best-{epoch}-{score:.1f}.npz"),
                                        monitor="score", save_best_only=True)
    model = _model()
    model.fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[script, every, best])
    names = sorted(os.listdir(tmp_path))
    assert names == ["all-01.safetensors", "all-02.safetensors", "all-03.safetensors",
                     "all-04.safetensors", "best-1-3.0.npz", "best-2-1.0.npz",
                     "best-4-0.5.npz"]
    fresh = _model()
    fresh(X[:1])                           # built under the strategy it was compiled in
    fresh.load_weights(str(tmp_path / "all-02.safetensors"))
    for a, b in zip(fresh.get_weights(), script.weights[1]):
        np.testing.assert_array_equal(a, b)
    fresh.load_weights(str(tmp_path / "best-4-0.5.npz"))
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_model_checkpoint_every_n_batches(tmp_path):
    """save_freq=2 over 2 epochs of 3 batches: after batches 2, 4 and 6 of training."""
    saver = gd.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}-{batch}-{loss:.3f}.npz"),
                                         save_freq=2)
    seen = []

    class Losses(gd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs["loss"])

    _model().fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[Losses(), saver])
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"w-1-2-{seen[1]:.3f}.npz", f"w-2-1-{seen[3]:.3f}.npz", f"w-2-3-{seen[5]:.3f}.npz"])


def test_model_checkpoint_with_the_optimizer(tmp_path):
    model = _model()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[
        gd.callbacks.ModelCheckpoint(str(tmp_path / "full.npz"), save_weights_only=False)])
    fresh = _model()
    fresh(X[:1])
    gd.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        str(tmp_path / "full.npz")).assert_consumed()
    assert fresh.optimizer.iterations.numpy() == 3


def test_early_stopping_patience_and_best_weights():
    script = Script("score", [1.0, 0.5, 0.6, 0.7, 0.8, 0.9])
    stop = gd.callbacks.EarlyStopping(monitor="score", patience=2, restore_best_weights=True)
    model = _model()
    history = model.fit(X, Y, batch_size=8, epochs=6, verbose=0, callbacks=[script, stop])
    assert history.epoch == [0, 1, 2, 3]          # best at 1; 2 and 3 without improvement
    assert stop.stopped_epoch == 3
    for a, b in zip(model.get_weights(), script.weights[1]):
        np.testing.assert_array_equal(a, b)


def test_early_stopping_min_delta_and_max_mode():
    script = Script("val_accuracy", [0.5, 0.505, 0.9, 0.9])
    stop = gd.callbacks.EarlyStopping(monitor="val_accuracy", min_delta=0.01, patience=1)
    history = _model().fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[script, stop])
    assert history.epoch == [0, 1]                 # +0.005 is no improvement at 0.01


def test_reduce_lr_on_plateau():
    script = Script("score", [1.0] * 8)
    plateau = gd.callbacks.ReduceLROnPlateau(monitor="score", factor=0.5, patience=2,
                                             min_lr=0.02)
    model = _model(lr=0.1)
    history = model.fit(X, Y, batch_size=8, epochs=8, verbose=0, callbacks=[script, plateau])
    # the logs show the rate the epoch ran with; reductions after epochs 2, 4 and 6, the
    # last one stopped at min_lr
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05,
                                                              0.025, 0.025, 0.02])
    assert model.optimizer.learning_rate.numpy() == pytest.approx(0.02)


def test_learning_rate_scheduler_sets_each_epochs_rate():
    rates = []

    class Rates(gd.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            rates.append(float(self.model.optimizer.learning_rate.numpy()))

    schedule = gd.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5 ** epoch)
    history = _model().fit(X, Y, batch_size=12, epochs=3, verbose=0,
                           callbacks=[schedule, Rates()])
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.025])


def test_csv_logger_writes_each_epoch(tmp_path):
    path = tmp_path / "log.csv"
    history = _model().fit(X, Y, batch_size=8, epochs=3, verbose=0,
                           validation_data=(X[:6], Y[:6]),
                           callbacks=[gd.callbacks.CSVLogger(str(path))])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert [float(r[key]) for r in rows] == pytest.approx(history.history[key])


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78), bit by bit: the TFRecord checksum."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _event_scalars(folder) -> dict:
    """{tag: [(step, value)]} from the TFRecord-framed event files of `folder` (length
    u64, its masked crc32c u32, the Event proto, its masked crc32c u32), every checksum
    checked as TensorBoard's reader checks them."""
    from tensorboardX.proto import event_pb2

    scalars: dict = {}
    for name in sorted(os.listdir(folder)):
        data = open(os.path.join(folder, name), "rb").read()
        at = 0
        while at < len(data):
            header = data[at:at + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[at + 8:at + 12])
            record = data[at + 12:at + 12 + length]
            (record_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
            assert header_crc == _masked(_crc32c(header))
            assert record_crc == _masked(_crc32c(record))
            at += 16 + length
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@needs_tensorboardx
def test_tensorboard_scalars_read_back(tmp_path):
    history = _model().fit(X, Y, batch_size=8, epochs=3, verbose=0,
                           validation_data=(X[:6], Y[:6]),
                           callbacks=[gd.callbacks.TensorBoard(str(tmp_path))])
    train = _event_scalars(tmp_path / "train")
    validation = _event_scalars(tmp_path / "validation")
    for key in ("loss", "accuracy"):
        assert [s for s, _ in train[f"epoch_{key}"]] == [0, 1, 2]
        assert [v for _, v in train[f"epoch_{key}"]] == pytest.approx(history.history[key])
        assert [v for _, v in validation[f"epoch_{key}"]] == pytest.approx(
            history.history[f"val_{key}"])


@needs_tensorboardx
def test_tensorboard_batch_values_every_n_batches(tmp_path):
    seen = []

    class Losses(gd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs["loss"])

    _model().fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[
        Losses(), gd.callbacks.TensorBoard(str(tmp_path), update_freq=2)])
    batches = _event_scalars(tmp_path / "train")["batch_loss"]
    assert [s for s, _ in batches] == [2, 4, 6]
    assert [v for _, v in batches] == pytest.approx([seen[1], seen[3], seen[5]])


class Crash(gd.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("the machine went away")


def _seeded_fit(model, seed, callbacks=(), epochs=3):
    with model.distribute_strategy.scope():
        gd.random.set_global_generator(gd.random.Generator(seed))
    return model.fit(X, Y, batch_size=8, epochs=epochs, verbose=0, callbacks=list(callbacks))


@pytest.mark.parametrize("save_freq, crash_at", [(2, (1, 1)), ("epoch", (2, 0))])
def test_backup_and_restore_resumes_an_interrupted_fit(tmp_path, save_freq, crash_at):
    reference = _model()
    ref_history = _seeded_fit(reference, seed=1)
    backup = str(tmp_path / "backup")

    interrupted = _model()
    with pytest.raises(KeyboardInterrupt):
        _seeded_fit(interrupted, 1, [gd.callbacks.BackupAndRestore(backup, save_freq),
                                     Crash(*crash_at)])
    assert os.path.exists(os.path.join(backup, "backup.npz"))

    resumed = _model()                         # a fresh process would start here
    steps = []

    class Steps(gd.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.append(batch)

    history = _seeded_fit(resumed, 99, [gd.callbacks.BackupAndRestore(backup, save_freq),
                                        Steps()])   # another seed: the backup's order wins
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert resumed.optimizer.iterations.numpy() == 9
    first_epoch = history.epoch[0]
    assert first_epoch == crash_at[0]
    assert steps[0] == (1 if save_freq == 2 else 0)  # the batch after the last backup
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"][first_epoch:],
                               rtol=1e-6)
    assert not os.path.exists(backup)               # a completed fit removes the backup


def test_callbacks_must_be_callbacks():
    with pytest.raises(TypeError, match="gd.callbacks.Callback"):
        _model().fit(X, Y, epochs=1, verbose=0, callbacks=[print])


# ---------------------------------------------------------------- multi-worker, SIGKILL
@needs_mpi
def test_backup_and_restore_after_a_killed_worker_under_launch_restarts(tmp_path):
    """tests/mpi/fit_restart.py on 2 workers: worker 1 SIGKILLed mid-epoch on the first
    attempt; the restarted job resumes from the backup and ends bit-equal to a job that was
    never interrupted."""
    runs = {}
    for name, extra, restarts in (("killed", ["kill"], ["--restarts", "1"]),
                                  ("whole", [], [])):
        out = tmp_path / name
        out.mkdir()
        done = subprocess.run([sys.executable, "-m", "graphdist", "launch", "-n", "2",
                               *restarts, FIT_RESTART, str(out), str(out / "backup"), *extra],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        runs[name] = (np.load(out / "final.npz"), done.stderr)
        assert not (out / "backup").exists()
    (killed, stderr), (whole, _) = runs["killed"], runs["whole"]
    assert "restarting the job" in stderr
    assert int(killed["attempt"]) == 1 and int(killed["first_epoch"]) == 1
    assert int(whole["attempt"]) == 0 and int(whole["first_epoch"]) == 0
    for k in range(4):
        np.testing.assert_array_equal(killed[f"arr_{k}"], whole[f"arr_{k}"])
    np.testing.assert_allclose(killed["loss"], whole["loss"][1:], rtol=1e-6)
    # and the 2 workers trained as one process on 2 devices does
    spec = importlib.util.spec_from_file_location("fit_restart", FIT_RESTART)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    one_process = script.compiled_model(gd.MirroredStrategy(["cpu:0", "cpu:1"]))
    history = script.fit(one_process)
    X_RESTART, Y_RESTART = script.X, script.Y
    for k, value in enumerate(one_process.get_weights()):
        np.testing.assert_allclose(whole[f"arr_{k}"], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole["loss"], history.history["loss"], rtol=1e-5)
    # evaluate and predict across the workers: every row once, in order (5-row batches
    # split 3 | 2 over the workers, the last one 2 | 0)
    np.testing.assert_allclose(whole["evaluated"], one_process.evaluate(X_RESTART, Y_RESTART,
                                                                        batch_size=5), rtol=1e-5)
    np.testing.assert_allclose(whole["predicted"], one_process.predict(X_RESTART, batch_size=5),
                               rtol=1e-5, atol=1e-6)
    assert whole["predicted"].shape == (22, 3)


def test_tensorboard_without_tensorboardx_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"graphdist\[tensorboard\]"):
        gd.callbacks.TensorBoard("logs")
