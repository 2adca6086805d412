"""gd.callbacks: Keras's training callbacks for gd.nn.Model.fit.

A Callback gets Keras's hooks (`on_train_begin/end`, `on_epoch_begin/end(epoch, logs)`,
`on_train_batch_begin/end(batch, logs)`, `on_test_begin/end`) and `self.model`. `logs` hold
Python floats: the running values of the epoch so far (the loss and each metric, each the
mean over the examples seen, as Keras reports them), and at the end of an epoch the
validation values as `val_*`. Under a multi-worker strategy every worker runs the callbacks
(they read global values); the ones that write files write on the chief only.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys

import numpy as np

from graphdist.checkpoint import Checkpoint
from graphdist.config import logger
from graphdist.distribute.values import VariableSynchronization
from graphdist.progress import ProgressBar
from graphdist.variables import Variable


def is_chief(model) -> bool:
    """Does this process write files (the chief of a multi-worker strategy, or the only
    process)?"""
    strategy = getattr(model, "distribute_strategy", None)
    return bool(getattr(strategy, "is_chief", True))


class Callback:
    """Base class: every hook does nothing; `self.model` is set by fit."""

    def __init__(self):
        self.model = None
        self.params: dict = {}

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def on_train_begin(self, logs=None): pass

    def on_train_end(self, logs=None): pass

    def on_epoch_begin(self, epoch, logs=None): pass

    def on_epoch_end(self, epoch, logs=None): pass

    def on_train_batch_begin(self, batch, logs=None): pass

    def on_train_batch_end(self, batch, logs=None): pass

    def on_test_begin(self, logs=None): pass

    def on_test_end(self, logs=None): pass

    def on_test_batch_begin(self, batch, logs=None): pass

    def on_test_batch_end(self, batch, logs=None): pass


def _crossed(model, every: int) -> bool:
    """Did the last execution (steps_per_execution batches) pass a multiple of `every`
    batches, counted from the start of training?"""
    done = model._batches_total
    return done // every > (done - model._last_execution) // every


def _overrides(callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class CallbackList:
    """The callbacks of one fit/evaluate call; `callbacks.on_epoch_end(epoch, logs)` calls
    each one's hook, in order. `wants(hook)` says whether any callback overrides `hook`:
    fit reads the running metrics for the batch hooks only then (a read sums over the
    replicas)."""

    def __init__(self, callbacks, model, params: dict):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks: expected gd.callbacks.Callback objects, got "
                                f"{type(cb).__name__}")
            cb.set_model(model)
            cb.set_params(params)

    def wants(self, hook: str) -> bool:
        return any(_overrides(cb, hook) for cb in self.callbacks)

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args):
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


class History(Callback):
    """Records each epoch's logs: `history` is {name: [value per epoch]}, `epoch` the
    epochs' indices. fit returns it (and sets model.history)."""

    def __init__(self):
        super().__init__()
        self.history: dict = {}
        self.epoch: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


def _format_logs(logs: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in logs.items() if isinstance(v, float))


class ProgbarLogger(Callback):
    """fit's verbose=1: a progress bar per epoch with the running loss and metrics, then the
    epoch's values (validation ones included); verbose=2: one line per epoch."""

    def __init__(self, verbose: int = 1, stream=None):
        super().__init__()
        self.verbose = int(verbose)
        self.stream = stream
        self.bar = None

    def on_epoch_begin(self, epoch, logs=None):
        epochs, steps = self.params.get("epochs"), self.params.get("steps")
        if self.verbose == 1:
            stream = self.stream or sys.stdout
            stream.write(f"Epoch {epoch + 1}/{epochs}\n")
            if steps:
                self.bar = ProgressBar(steps, stream=stream, unit="batches")

    def on_train_batch_end(self, batch, logs=None):
        if self.bar is not None:
            self.bar.update(batch + 1, _format_logs(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        stream = self.stream or sys.stdout
        self.bar = None
        if self.verbose == 2:
            stream.write(f"Epoch {epoch + 1}/{self.params.get('epochs')}  ")
        if self.verbose:
            stream.write(_format_logs(logs or {}) + "\n")
            stream.flush()


def _monitor_mode(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    return "max" if name.startswith(("acc", "auc", "precision", "recall")) or \
        name.endswith("accuracy") else "min"


class _Monitor:
    """A monitored log value, and whether a new one improves on the best so far."""

    def __init__(self, monitor: str, mode: str, min_delta: float = 0.0):
        self.monitor = monitor
        self.mode = _monitor_mode(monitor, mode)
        self.min_delta = abs(float(min_delta))
        self.best = np.inf if self.mode == "min" else -np.inf

    def value(self, logs, who: str):
        value = (logs or {}).get(self.monitor)
        if value is None:
            logger.warning("%s: the logs have no %r (they have %s); nothing is monitored",
                           who, self.monitor, sorted(logs or {}))
        return value

    def improves(self, value) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class ModelCheckpoint(Callback):
    """Saves the model at the end of every epoch (or every `save_freq` batches):
    `filepath` is formatted with `epoch` (counted from 1, as in Keras), with `batch` (within
    the epoch, from 1) when saving every `save_freq` batches, and with the logs' values
    ("w-{epoch:02d}-{val_loss:.2f}.safetensors"). save_weights_only=True writes
    model.save_weights(path) (safetensors for a .safetensors suffix, else the checkpoint
    format); False writes a gd.Checkpoint of the model and its optimizer. With
    `save_best_only` only a `monitor` value better than every earlier one saves. Under a
    multi-worker strategy every worker takes part and the chief writes."""

    def __init__(self, filepath, monitor: str = "val_loss", save_best_only: bool = False,
                 save_weights_only: bool = True, save_freq="epoch", mode: str = "auto",
                 verbose: int = 0):
        super().__init__()
        self.filepath = os.fspath(filepath)
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"ModelCheckpoint: save_freq must be 'epoch' or a positive int "
                             f"(batches), got {save_freq!r}")
        self.save_freq = save_freq
        self.verbose = verbose
        self._monitor = _Monitor(monitor, mode)
        self.monitor = monitor
        self._epoch = 0

    best = property(lambda self: self._monitor.best)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq != "epoch" and _crossed(self.model, self.save_freq):
            self._save(self._epoch, logs, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, logs)

    def _save(self, epoch: int, logs, batch: int | None = None) -> None:
        logs = dict(logs or {})
        if self.save_best_only:
            value = self._monitor.value(logs, "ModelCheckpoint")
            if value is None or not self._monitor.improves(value):
                return
            self._monitor.best = value
        try:
            fields = {"epoch": epoch + 1, **({} if batch is None else {"batch": batch})}
            path = self.filepath.format(**fields, **logs)
        except KeyError as e:
            raise KeyError(f"ModelCheckpoint: filepath {self.filepath!r} names {e}, which the "
                           f"logs do not have (they have {sorted(logs)})") from None
        if os.path.dirname(path) and is_chief(self.model):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.save_weights_only:
            self.model.save_weights(path)
        else:
            Checkpoint(model=self.model, optimizer=self.model.optimizer).save(path)


class EarlyStopping(Callback):
    """Stops fit when `monitor` has not improved by more than `min_delta` for `patience`
    epochs; with restore_best_weights the model ends with the weights of its best epoch."""

    def __init__(self, monitor: str = "val_loss", min_delta=0, patience: int = 0,
                 mode: str = "auto", restore_best_weights: bool = False, verbose: int = 0):
        super().__init__()
        self.monitor = monitor
        self.patience = int(patience)
        self.restore_best_weights = bool(restore_best_weights)
        self._mode, self._min_delta = mode, min_delta
        self._monitor = _Monitor(monitor, mode, min_delta)
        self.wait = 0
        self.stopped_epoch = 0
        self.best_weights = None
        self.best_epoch = 0

    def on_train_begin(self, logs=None):
        self._monitor = _Monitor(self.monitor, self._mode, self._min_delta)
        self.wait, self.stopped_epoch, self.best_weights = 0, 0, None

    def on_epoch_end(self, epoch, logs=None):
        value = self._monitor.value(logs, "EarlyStopping")
        if value is None:
            return
        if self._monitor.improves(value):
            self._monitor.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.restore_best_weights and self.best_weights is not None:
            self.model.set_weights(self.best_weights)


def _learning_rate(model) -> float:
    lr = model.optimizer.learning_rate
    if not isinstance(lr, Variable):
        raise TypeError("the optimizer's learning rate is a schedule; a callback that sets "
                        "it needs an optimizer made with a number")
    return float(lr.numpy())


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by `factor` when `monitor` has not improved (by more
    than `min_delta`) for `patience` epochs, down to `min_lr`; then waits `cooldown`
    epochs before counting again."""

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 min_lr: float = 0.0, mode: str = "auto", min_delta: float = 1e-4,
                 cooldown: int = 0, verbose: int = 0):
        super().__init__()
        if not 0 < float(factor) < 1:
            raise ValueError(f"ReduceLROnPlateau: factor must be in (0, 1), got {factor}")
        self.monitor, self.factor, self.patience = monitor, float(factor), int(patience)
        self.min_lr, self.cooldown = float(min_lr), int(cooldown)
        self._monitor = _Monitor(monitor, mode, min_delta)
        self.wait = self.cooldown_counter = 0

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        logs["learning_rate"] = _learning_rate(self.model)
        value = self._monitor.value(logs, "ReduceLROnPlateau")
        if value is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._monitor.improves(value):
            self._monitor.best, self.wait = value, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = _learning_rate(self.model)
                if old > self.min_lr:
                    self.model.optimizer.learning_rate = max(old * self.factor, self.min_lr)
                self.cooldown_counter, self.wait = self.cooldown, 0


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of every epoch to schedule(epoch, lr) (or
    schedule(epoch)), as Keras's; the epoch's logs get `learning_rate`."""

    def __init__(self, schedule, verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise TypeError(f"LearningRateScheduler: schedule must be callable, got "
                            f"{type(schedule).__name__}")
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        lr = _learning_rate(self.model)
        try:
            new = self.schedule(epoch, lr)
        except TypeError:
            new = self.schedule(epoch)
        if not isinstance(new, (float, int, np.floating, np.integer)):
            raise ValueError(f"LearningRateScheduler: the schedule returned {new!r} for epoch "
                             f"{epoch}; it must return a number")
        self.model.optimizer.learning_rate = float(new)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _learning_rate(self.model)


class CSVLogger(Callback):
    """Writes one row per epoch (`epoch`, then the logs' keys in sorted order) to
    `filename`; `append=True` continues an existing file (a resumed fit). The chief writes."""

    def __init__(self, filename, separator: str = ",", append: bool = False):
        super().__init__()
        self.filename, self.separator, self.append = os.fspath(filename), separator, append
        self.keys = None
        self._file = None
        self._writer = None

    def on_train_begin(self, logs=None):
        if not is_chief(self.model):
            return
        exists = self.append and os.path.exists(self.filename) and \
            os.path.getsize(self.filename) > 0
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._header_written = exists

    def on_epoch_end(self, epoch, logs=None):
        if self._file is None:
            return
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs)
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=["epoch"] + self.keys,
                                          delimiter=self.separator, extrasaction="ignore")
            if not self._header_written:
                self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **{k: logs.get(k, "NA") for k in self.keys}})
        self._file.flush()

    def on_train_end(self, logs=None):
        if self._file is not None:
            self._file.close()
        self._file = self._writer = None


class TensorBoard(Callback):
    """Writes event files that TensorBoard reads: each epoch's training values under
    `log_dir/train` and the validation ones under `log_dir/validation`, with Keras's tags
    (`epoch_loss`, `epoch_accuracy`, ...), step = epoch; `update_freq=N` also writes the
    running training values as `batch_*` every N batches. Written with tensorboardX (the
    `tensorboard` extra: pip install 'graphdist[tensorboard]'); the chief writes."""

    def __init__(self, log_dir="logs", update_freq="epoch"):
        super().__init__()
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ImportError("gd.callbacks.TensorBoard writes with tensorboardX: install the "
                              "'tensorboard' extra (pip install 'graphdist[tensorboard]')") \
                from None
        self.log_dir = os.fspath(log_dir)
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise ValueError(f"TensorBoard: update_freq must be 'epoch' or a positive int, "
                             f"got {update_freq!r}")
        self.update_freq = update_freq
        self._writers: dict = {}

    def _writer(self, which: str):
        if which not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[which] = SummaryWriter(os.path.join(self.log_dir, which))
        return self._writers[which]

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch" or not is_chief(self.model):
            return
        if _crossed(self.model, self.update_freq):
            step = self.model._batches_total
            for key, value in (logs or {}).items():
                self._writer("train").add_scalar(f"batch_{key}", value, step)

    def on_epoch_end(self, epoch, logs=None):
        if not is_chief(self.model):
            return
        for key, value in (logs or {}).items():
            which, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(which).add_scalar(f"epoch_{name}", value, epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


class BackupAndRestore(Callback):
    """Backs up the training state in `backup_dir` at the end of every epoch (or every
    `save_freq` batches): the model's weights, the optimizer's state, the metrics, the epoch
    and batch reached and the seed of the data order. A fit that finds a backup at its start
    (after an exception, or in a job restarted by `graphdist launch --restarts`) resumes at
    that epoch and batch, with the same data order, and ends with the same weights as an
    uninterrupted fit. A fit that completes deletes the backup. The chief writes."""

    FILE = "backup.npz"

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True):
        super().__init__()
        self.backup_dir = os.fspath(backup_dir)
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"BackupAndRestore: save_freq must be 'epoch' or a positive int "
                             f"(batches), got {save_freq!r}")
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self._state = None
        self._epoch = 0

    @property
    def path(self) -> str:
        return os.path.join(self.backup_dir, self.FILE)

    def _checkpoint(self) -> Checkpoint:
        model = self.model
        if self._state is None:
            with model.distribute_strategy.scope():   # epoch, batch, data-order seed
                self._state = Variable(np.zeros(3, np.int64), name="backup_and_restore/state",
                                       trainable=False,
                                       synchronization=VariableSynchronization.AUTO)
        return Checkpoint(model=model, optimizer=model.optimizer,
                          metrics={m.name: m for m in model.metrics}, state=self._state)

    def on_train_begin(self, logs=None):
        checkpoint = self._checkpoint()
        if not os.path.exists(self.path):
            return
        checkpoint.restore(self.path).assert_consumed()
        epoch, batch, seed = (int(v) for v in self._state.numpy())
        self.model._resume_from(epoch, batch, seed)
        logger.info("BackupAndRestore: resuming from %s at epoch %d, batch %d", self.path,
                    epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq != "epoch" and _crossed(self.model, self.save_freq):
            self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def _save(self, epoch: int, batch: int) -> None:
        self._state.assign(np.array([epoch, batch, self.model._data_seed], np.int64))
        if is_chief(self.model):
            os.makedirs(self.backup_dir, exist_ok=True)
        self._checkpoint().save(self.path)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and is_chief(self.model) and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)


__all__ = ["BackupAndRestore", "CSVLogger", "Callback", "CallbackList", "EarlyStopping",
           "History", "LearningRateScheduler", "ModelCheckpoint", "ProgbarLogger",
           "ReduceLROnPlateau", "TensorBoard"]
