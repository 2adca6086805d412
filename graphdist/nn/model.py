"""gd.nn.Model (Keras's compile / fit / evaluate / predict) and gd.nn.Sequential.

The model owns the loop and the reductions users otherwise write by hand:
- fit splits each global batch over the strategy's replicas and sums each replica's
  per-example losses divided by the global batch size of the step, with the optimizer's
  gradient reduction accounted for, so a step on N replicas, on uneven shards or on a
  partial last batch, updates as one device on that batch;
- the epoch's loss and metrics are sync-on-read sums over every example (no replica's
  value stands for the others), read as global values;
- steps_per_execution=k runs k steps per compiled call (strategy.experimental_run_steps).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math

import numpy as np

from graphdist import callbacks as callbacks_module
from graphdist import config, losses, metrics as metrics_module
from graphdist.distribute.context import get_strategy, has_strategy
from graphdist.errors import ShapeError
from graphdist.autodiff import GradientTape
from graphdist.function import function
from graphdist.nn.layers import Layer, _shape
from graphdist.ops.array import cast
from graphdist.ops.math import multiply, reduce_mean, reduce_sum
from graphdist.optimizers.loss_scale import LossScaleOptimizer
from graphdist.trace import name_scope


def _rows(x) -> int:
    return int(_shape(x)[0])


def _take(x, index):
    """Rows `index` (a slice or an index array) of an array or a tuple/list/dict of them."""
    if isinstance(x, dict):
        return {k: _take(v, index) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_take(v, index) for v in x)
    return np.asarray(x)[index]


def _first_leaf(x):
    if isinstance(x, dict):
        return _first_leaf(next(iter(x.values())))
    if isinstance(x, (tuple, list)):
        return _first_leaf(x[0])
    return x


class _Peekable:
    """An iterator that can say whether another item follows without losing it."""

    def __init__(self, iterable):
        self._it = iter(iterable)
        self._next = collections.deque()

    def has_next(self) -> bool:
        if not self._next:
            try:
                self._next.append(next(self._it))
            except StopIteration:
                return False
        return True

    def peek(self):
        if not self.has_next():
            raise ValueError("fit: the dataset is empty")
        return self._next[0]

    def __iter__(self):
        return self

    def __next__(self):
        if self._next:
            return self._next.popleft()
        return next(self._it)


class Model(Layer):
    """A layer that can be compiled and trained. Subclass it and define `call(self, x,
    training=False)` with sublayers as attributes, or use gd.nn.Sequential.

    >>> model = gd.nn.Sequential([gd.nn.Dense(10)])
    >>> model.compile(gd.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
    ...               metrics=["accuracy"])                          # doctest: +SKIP
    >>> history = model.fit(x, y, batch_size=64, epochs=3)           # doctest: +SKIP
    """

    default_name = "model"

    def __init__(self, name=None, dtype=None):
        super().__init__(name, dtype)
        self.optimizer = None
        self.compiled_loss = None
        self.loss = None
        self.stop_training = False
        self.history = None
        self.distribute_strategy = None
        self._compiled_metrics: list = []
        self._loss_tracker = None
        self._steps_per_execution = 1
        self._bodies: dict = {}          # "train"/"test" -> the step as run_steps's fn
        self._single_steps: dict = {}    # "train"/"test" -> gd.function of one step
        self._predict_fn = None
        self._data_seed = 0
        self._resume = None
        self._batches_total = 0      # batches trained in this fit (callbacks' save_freq)
        self._last_execution = 0     # batches the last compiled call ran

    def _variable_scope(self):
        """Where a first call makes the variables: the compiled model's strategy when the
        call comes from outside every strategy (model(x) after compile, as Keras builds a
        model under the strategy it was compiled under)."""
        if self.built or self.distribute_strategy is None or has_strategy():
            return contextlib.nullcontext()
        return self.distribute_strategy.scope()

    def __call__(self, x, training=False):
        with self._variable_scope():
            return super().__call__(x, training)

    # ------------------------------------------------------------ compile
    def compile(self, optimizer, loss, metrics=None, steps_per_execution: int = 1) -> None:
        """Set the optimizer, the loss and the metrics (made under the current strategy's
        scope: call compile inside it, or outside any strategy). Under the mixed_float16
        policy the optimizer is wrapped in a LossScaleOptimizer, as Keras does."""
        if not callable(getattr(optimizer, "apply_gradients", None)):
            raise TypeError(f"compile: optimizer must be a gd.optimizers optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) \
                or steps_per_execution < 1:
            raise ValueError(f"compile: steps_per_execution must be an int >= 1, got "
                             f"{steps_per_execution!r}")
        loss_fn, loss_name = losses.get(loss)
        strategy = get_strategy()
        self._check_built_under(strategy)
        with strategy.scope():
            if config.precision() == "mixed_float16" and \
                    not isinstance(optimizer, LossScaleOptimizer):
                optimizer = LossScaleOptimizer(optimizer)
            made = [metrics_module.get(m, loss_name) for m in (metrics or [])]
            tracker = metrics_module.Mean(name="loss")
        names = [m.name for m in made]
        if len(set(names)) != len(names) or "loss" in names:
            raise ValueError(f"compile: metric names must be unique and not 'loss', got "
                             f"{names}")
        self.distribute_strategy = strategy
        self.optimizer, self.loss, self.compiled_loss = optimizer, loss, loss_fn
        self._compiled_metrics, self._loss_tracker = made, tracker
        self._steps_per_execution = steps_per_execution
        self._bodies, self._single_steps, self._predict_fn = {}, {}, None

    def _check_built_under(self, strategy) -> None:
        """A model whose variables were made under another strategy cannot train under
        this one (TF: "the model must be created under the same strategy scope")."""
        owner = next((v._strategy for v in self.variables), strategy)
        if owner is not strategy:
            raise ValueError(f"compile: {type(self).__name__} '{self.name}' made its variables "
                             f"under {owner!r}, and compile is called under {strategy!r}; "
                             "make the model (and call it, if you build it by a call) inside "
                             "the same strategy.scope() as compile")

    @property
    def metrics(self) -> list:
        """The loss tracker ("loss") and the compiled metrics, in order."""
        return ([self._loss_tracker] if self._loss_tracker else []) + self._compiled_metrics

    @property
    def metrics_names(self) -> list:
        return [m.name for m in self.metrics]

    def _require_compiled(self, method: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__} '{self.name}': call compile(optimizer, "
                               f"loss) before {method}")

    def _optimizer_reduction(self) -> tuple[str, int]:
        """The optimizer's gradient reduction and gradient accumulation steps."""
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        steps = getattr(inner, "gradient_accumulation_steps", 1) or 1
        return getattr(inner, "gradient_reduction", "mean"), int(steps)

    def _loss_scale(self, global_batch: int) -> np.float32:
        """What a replica's sum of per-example losses is multiplied by. With a "sum"
        gradient reduction: 1 / global batch (1 / (k global batches) when the optimizer
        accumulates k micro-batches), so the summed gradients are one device's on the
        batch. With "mean" (the default), the all-reduce divides by the replica count, so
        the factor is N / global batch (accumulation's mean of k micro-batches is right
        as it is)."""
        reduction, steps = self._optimizer_reduction()
        if reduction == "sum":
            return np.float32(1.0 / (global_batch * steps))
        return np.float32(self.distribute_strategy.num_replicas_in_sync / global_batch)

    # ------------------------------------------------------------ the compiled steps
    def _per_example_loss(self, y, y_pred):
        per_example = self.compiled_loss(y, y_pred)
        if len(_shape(per_example)) == 0 or _shape(per_example)[0] != _shape(y_pred)[0]:
            raise ShapeError(f"{type(self).__name__} '{self.name}': the loss {self.loss!r} "
                             f"returned shape {_shape(per_example)} for a batch of "
                             f"{_shape(y_pred)[0]}; it must return one value per example "
                             "(the model divides their sum by the global batch size)")
        if np.dtype(per_example.dtype).itemsize < 4:
            per_example = cast(per_example, "float32")
        if len(_shape(per_example)) > 1:        # (batch, time): each example's mean, so the
            per_example = reduce_mean(            # step's loss is the mean over every element,
                per_example, axis=tuple(range(1, len(_shape(per_example)))))   # as Keras's
        return per_example

    def _update_metrics(self, x, y, y_pred, per_example) -> None:
        self._loss_tracker.add_sum(reduce_sum(per_example), np.float32(_rows(_first_leaf(x))))
        for metric in self._compiled_metrics:
            metric.update_state(y, y_pred)

    def train_step(self, x, y, scale):
        """One replica's step (traced inside strategy.run): the forward pass, the loss as
        the shard's sum of per-example losses times `scale`, the update and the metrics."""
        opt = self.optimizer
        scaled = isinstance(opt, LossScaleOptimizer)
        with GradientTape() as tape:
            y_pred = self(x, training=True)
            per_example = self._per_example_loss(y, y_pred)
            loss = multiply(reduce_sum(per_example), cast(scale, per_example.dtype))
            if scaled:
                loss = opt.get_scaled_loss(loss)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        if scaled:
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, variables))
        self._update_metrics(x, y, y_pred, per_example)

    def test_step(self, x, y):
        """One replica's evaluation step: the loss and metrics of its shard."""
        y_pred = self(x, training=False)
        self._update_metrics(x, y, y_pred, self._per_example_loss(y, y_pred))

    def _step_body(self, which: str):
        """fn(ctx, *batch) of one training ("train") or evaluation ("test") step, in
        cross-replica context: strategy.run of train_step / test_step on the shards."""
        if which not in self._bodies:
            strategy = self.distribute_strategy
            replica_fn = self.train_step if which == "train" else self.test_step

            def steps(ctx, *batch):
                with strategy.scope():
                    strategy.run(replica_fn, args=batch)

            steps.__name__ = f"{self.name}_{which}_step"
            self._bodies[which] = steps
        return self._bodies[which]

    def _execute(self, which: str, batches) -> int:
        """Run the next steps_per_execution steps on `batches`; returns how many ran. k > 1
        is one strategy.experimental_run_steps call; one step is a plain gd.function call
        (about 0.1 ms less per step than a loop of one, which re-derives the signature)."""
        body = self._step_body(which)
        if self._steps_per_execution > 1:
            return self.distribute_strategy.experimental_run_steps(
                body, batches, self._steps_per_execution).steps_run
        if which not in self._single_steps:
            step = function(lambda *batch: body(None, *batch))
            step.__name__ = body.__name__
            self._single_steps[which] = step
        self._single_steps[which](*next(batches))
        return 1

    def _predict_function(self):
        if self._predict_fn is None:
            strategy = self.distribute_strategy

            def predict_step(x):
                out = strategy.run(lambda shard: self(shard, training=False), args=(x,))
                return strategy.gather(out, axis=0)

            predict_step.__name__ = f"{self.name}_predict_step"
            self._predict_fn = function(predict_step)
        return self._predict_fn

    # ------------------------------------------------------------ data
    def _batches(self, x, y, batch_size: int, order=None, skip: int = 0):
        """Global batches (x, y) of arrays, in `order` (row indices) or in order, the last
        one partial; the first `skip` are left out. Or, for an iterable of batches `x`,
        its batches."""
        if y is None and not isinstance(x, np.ndarray):
            it = iter(x)
            for _ in range(skip):
                next(it, None)
            yield from it
            return
        n = _rows(_first_leaf(x))
        for start in range(skip * batch_size, n, batch_size):
            index = slice(start, start + batch_size) if order is None else \
                order[start:start + batch_size]
            yield (_take(x, index), _take(y, index)) if y is not None else _take(x, index)

    def _distributed(self, batches, with_scale: bool):
        """The strategy's per-replica shards of each global batch (x, y), with the loss
        scale of the batch's global size when `with_scale`."""
        sizes = collections.deque()

        def recorded():
            for batch in batches:
                sizes.append(_rows(_first_leaf(batch[0])))
                yield tuple(batch)

        dist = self.distribute_strategy.experimental_distribute_dataset(recorded())
        for batch in dist:
            size = sizes.popleft()
            yield (*batch, self._loss_scale(size)) if with_scale else batch

    @staticmethod
    def _steps_of(x, y, batch_size: int):
        if y is None and not isinstance(x, np.ndarray):
            return len(x) if hasattr(x, "__len__") else None
        return math.ceil(_rows(_first_leaf(x)) / batch_size)

    def _ensure_built(self, x, y) -> None:
        """Make the variables (under the strategy, before any trace) from one example."""
        if self.built:
            return
        if isinstance(x, _Peekable):
            first = x.peek()
        elif y is None and not isinstance(x, np.ndarray):
            first = next(iter(x))
        else:
            first = x
        sample = first[0] if isinstance(first, tuple) and y is None else first
        with self.distribute_strategy.scope():
            self(_take(sample, slice(0, 1)), training=False)

    def _logs(self) -> dict:
        return {m.name: float(m.result()) for m in self.metrics}

    def _reset_metrics(self) -> None:
        for m in self.metrics:
            m.reset_state()

    def _resume_from(self, epoch: int, batch: int, seed: int) -> None:
        """BackupAndRestore: the next fit starts at `epoch`, `batch`, with data order `seed`
        (the metrics were restored with the backup)."""
        self._resume = (epoch, batch, seed)

    # ------------------------------------------------------------ fit
    def fit(self, x=None, y=None, batch_size: int = 32, epochs: int = 1, validation_data=None,
            callbacks=None, shuffle: bool = True, initial_epoch: int = 0, verbose: int = 1,
            steps_per_epoch: int | None = None):
        """Train for `epochs` epochs over `x`, `y` (arrays: global batches of `batch_size`,
        shuffled each epoch, the last one partial) or over `x`, an iterable of (x, y)
        global batches (an iterator or generator is read on across epochs; give
        `steps_per_epoch` for an endless one). Returns a gd.callbacks.History."""
        self._require_compiled("fit")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"fit: batch_size must be an int >= 1, got {batch_size!r}")
        if y is not None and _rows(_first_leaf(x)) != _rows(_first_leaf(y)):
            raise ValueError(f"fit: x has {_rows(_first_leaf(x))} rows, y has "
                             f"{_rows(_first_leaf(y))}")
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(
                steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"fit: steps_per_epoch must be an int >= 1 or None, got "
                             f"{steps_per_epoch!r}")
        if y is None and not isinstance(x, np.ndarray) and iter(x) is x:
            x = _Peekable(x)            # an iterator: build from its first batch, keep it
        self._ensure_built(x, y)
        history = callbacks_module.History()
        extra = [callbacks_module.ProgbarLogger(verbose)] if verbose else []
        steps = steps_per_epoch or self._steps_of(x, y, batch_size)
        cbs = callbacks_module.CallbackList(list(callbacks or []) + extra + [history], self,
                                            {"epochs": epochs, "steps": steps,
                                             "verbose": verbose})
        batch_logs = cbs.wants("on_train_batch_end")
        self.stop_training, self.history = False, history
        self._batches_total = self._last_execution = 0
        with self.distribute_strategy.scope():
            self._data_seed = self._draw_seed()
        self._resume = None
        cbs.on_train_begin()
        first_epoch, skip = initial_epoch, 0
        if self._resume is not None:
            first_epoch, skip, self._data_seed = self._resume
            self._resume = None
        logs = {}
        for epoch in range(first_epoch, epochs):
            if skip == 0:
                self._reset_metrics()
            cbs.on_epoch_begin(epoch)
            order = self._order(x, y, epoch, shuffle)
            epoch_batches = self._batches(x, y, batch_size, order, skip)
            if steps_per_epoch is not None:
                epoch_batches = itertools.islice(epoch_batches, steps_per_epoch - skip)
            batches = _Peekable(self._distributed(epoch_batches, True))
            step = skip
            while not self.stop_training and batches.has_next():
                cbs.on_train_batch_begin(step)
                ran = self._execute("train", batches)
                step += ran
                self._batches_total += ran
                self._last_execution = ran
                cbs.on_train_batch_end(step - 1, self._logs() if batch_logs else None)
            skip = 0
            logs = self._logs()
            if validation_data is not None:
                val = self._evaluate(*self._xy(validation_data), batch_size, cbs)
                logs.update({f"val_{k}": v for k, v in val.items()})
            cbs.on_epoch_end(epoch, logs)
            if self.stop_training:
                break
        cbs.on_train_end(logs)
        return history

    def _draw_seed(self) -> int:
        """The seed of this fit's data order, from the strategy's global generator (so
        gd.random.set_global_generator makes it reproducible; every worker draws the same)."""
        from graphdist.random import draw_now

        return int(draw_now("uniform", (), "float64") * 2**52)

    def _order(self, x, y, epoch: int, shuffle: bool):
        if not shuffle or (y is None and not isinstance(x, np.ndarray)):
            return None
        rng = np.random.default_rng([self._data_seed, epoch])
        return rng.permutation(_rows(_first_leaf(x)))

    @staticmethod
    def _xy(data):
        if isinstance(data, tuple) and len(data) == 2:
            return data
        return data, None

    # ------------------------------------------------------------ evaluate, predict
    def evaluate(self, x=None, y=None, batch_size: int = 32, return_dict: bool = False,
                 callbacks=None, verbose: int = 0):
        """The loss and metrics over every example of `x`, `y` exactly once (a partial last
        batch counted once, on any replica count): `[loss, *metrics]` (the loss alone when
        there are no metrics, as Keras), or a dict with `return_dict`."""
        self._require_compiled("evaluate")
        self._ensure_built(x, y)
        cbs = callbacks_module.CallbackList(list(callbacks or []), self, {"verbose": verbose})
        logs = self._evaluate(x, y, batch_size, cbs)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _evaluate(self, x, y, batch_size: int, cbs) -> dict:
        self._reset_metrics()
        cbs.on_test_begin()
        batches = _Peekable(self._distributed(self._batches(x, y, batch_size), False))
        step = 0
        while batches.has_next():
            cbs.on_test_batch_begin(step)
            step += self._execute("test", batches)
            cbs.on_test_batch_end(step - 1)
        logs = self._logs()
        cbs.on_test_end(logs)
        return logs

    def predict(self, x, batch_size: int = 32, verbose: int = 0) -> np.ndarray:
        """The model's outputs (training=False) for every row of `x` (an array, or an
        iterable of batches: x, or (x, y) whose y is ignored), in order.

        Each batch is padded (its last row repeated) to a multiple of the replica count, so
        every replica's shard has the same shape: the outputs are gathered across the
        replicas (and workers, which must agree on the shapes they exchange), and the
        padding's rows are dropped."""
        if self.distribute_strategy is None:
            self.distribute_strategy = get_strategy()
        if not isinstance(x, np.ndarray) and iter(x) is x:
            x = _Peekable(x)
        self._ensure_built(x, None)
        step = self._predict_function()
        replicas = self.distribute_strategy.num_replicas_in_sync
        if isinstance(x, np.ndarray):                        # arrays: one shape throughout
            even = math.ceil(min(batch_size, _rows(x)) / replicas) * replicas
        sizes = collections.deque()

        def padded():
            for batch in self._batches(x, None, batch_size):
                batch = batch[0] if isinstance(batch, tuple) else batch
                rows = _rows(_first_leaf(batch))
                sizes.append(rows)
                size = even if isinstance(x, np.ndarray) else math.ceil(rows / replicas) * replicas
                yield _take(batch, np.minimum(np.arange(size), rows - 1)) if size != rows \
                    else batch

        outputs = []
        with self.distribute_strategy.scope():
            for batch in self.distribute_strategy.experimental_distribute_dataset(padded()):
                outputs.append(np.asarray(step(batch))[:sizes.popleft()])
        return np.concatenate(outputs, axis=0)

    # ------------------------------------------------------------ weights
    def get_weights(self) -> list:
        """Every variable's value (numpy), in `variables` order."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights) -> None:
        variables = self.variables
        weights = list(weights)
        if len(weights) != len(variables):
            raise ValueError(f"set_weights: the model has {len(variables)} variables, got "
                             f"{len(weights)} values")
        for v, w in zip(variables, weights):
            if np.shape(w) != v.shape:
                raise ValueError(f"set_weights: variable '{v.name}' has shape {v.shape}, the "
                                 f"value {np.shape(w)}")
        with (self.distribute_strategy or get_strategy()).scope():
            for v, w in zip(variables, weights):
                v.assign(np.asarray(w, v.dtype))

    def save_weights(self, path) -> str:
        """Write the model's variables to `path`: a `.safetensors` file (the safetensors
        format, `safetensors` package), else the checkpoint format. The chief writes."""
        from graphdist.nn.weights import save_weights

        return save_weights(self, path)

    def load_weights(self, path) -> None:
        """Read the variables save_weights wrote (every one, with its shape and dtype);
        raises gd.CheckpointError naming the file and the entry, changing nothing."""
        from graphdist.nn.weights import load_weights

        load_weights(self, path)


class Sequential(Model):
    """Layers applied in order; `training` is passed to each. A Model: compile and fit it.

    >>> model = gd.nn.Sequential([gd.nn.Flatten(), gd.nn.Dense(10)])
    """

    default_name = "sequential"

    def __init__(self, layers=None, name=None):
        super().__init__(name)
        self.layers: list = []
        for layer in layers or []:
            self.add(layer)

    def add(self, layer: Layer) -> None:
        if not isinstance(layer, Layer):
            raise TypeError(f"Sequential '{self.name}': expected a gd.nn layer, got "
                            f"{type(layer).__name__}")
        self.layers.append(layer)

    def __call__(self, x, training=False):
        with self._variable_scope():
            if not self.built:
                self.built, self.input_shape = True, _shape(x)
            with name_scope(self.name):
                for layer in self.layers:
                    x = layer(x, training=training)
        return x


__all__ = ["Model", "Sequential"]
