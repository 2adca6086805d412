"""The two recipe mismatches that make N replicas train differently from one device warn in
ordinary runs, naming the user's line, once per function; the correct recipes do not."""

import warnings
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd

HERE = Path(__file__).name


def _line(marker: str) -> int:
    """The line number of the line of this file that ends with `# <marker>`."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


def _setup(loss_kind: str, reduction: str = "mean", devices: int = 2, global_batch=None):
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)])
    with strategy.scope():
        w = gd.Variable(np.ones((3, 2), np.float32), name="w")
        opt = gd.optimizers.SGD(0.1, gradient_reduction=reduction)

    @gd.function
    def step(batch):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                per_example = gd.reduce_sum(gd.square(x @ w), axis=1)
                if loss_kind == "mean":
                    loss = gd.reduce_mean(per_example)  # per-replica mean
                else:
                    loss = gd.nn.compute_average_loss(  # average loss
                        per_example, global_batch_size=global_batch)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))  # apply
            return loss
        return strategy.run(replica_fn, args=(batch,))

    def call(rows: int):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) / 10
        return step(next(iter(strategy.experimental_distribute_dataset([x]))))

    return call


def _recipe_warnings(record) -> list:
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


def test_a_per_replica_mean_on_uneven_shards_warns_once_naming_the_line():
    call = _setup("mean")
    with pytest.warns(UserWarning, match="the shards are uneven") as record:
        call(3)                                          # rows 2 | 1
    message = str(record[0].message)
    assert f"reduce_mean at {HERE}:{_line('per-replica mean')}" in message
    assert "2, 1 elements on replicas 0..1" in message
    assert "gradient_reduction='mean'" in message and "compute_average_loss" in message
    assert record[0].filename == HERE and record[0].lineno == _line("per-replica mean")
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        call(5)                                          # 3 | 2: a new trace, same function
    assert _recipe_warnings(again) == []


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")
def test_an_empty_shard_warns_that_its_mean_is_nan():
    call = _setup("mean")
    with pytest.warns(UserWarning, match="an empty shard's mean is NaN"):
        call(1)                                          # 1 | 0


def test_a_mean_on_even_shards_and_the_sum_recipe_on_uneven_ones_do_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _setup("mean")(4)                                # 2 | 2: every replica alike
        _setup("average", reduction="sum", global_batch=3)(3)   # the recipe for 2 | 1
        _setup("mean", devices=1)(3)                     # one device: nothing to average
    assert _recipe_warnings(record) == []


def test_compute_average_loss_with_an_averaging_optimizer_warns_naming_both_lines():
    call = _setup("average")
    with pytest.warns(UserWarning, match="each update is 1/2 of one device's") as record:
        call(4)
    message = str(record[0].message)
    assert f"compute_average_loss at {HERE}:{_line('average loss')}" in message
    assert f"the optimizer at {HERE}:{_line('apply')}" in message
    assert "gradient_reduction='sum'" in message
    assert record[0].lineno == _line("apply")
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        call(6)                                          # retraced: said once already
    assert _recipe_warnings(again) == []


def test_compute_average_loss_with_a_summing_optimizer_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _setup("average", reduction="sum")(4)
        _setup("average", devices=1)(4)
    assert _recipe_warnings(record) == []
