"""Fixtures shared by the ports of TensorFlow's tf.distribute tests (tests/tf_compat/):
the two-replica MirroredStrategy that TF's `mirrored_strategy_with_gpu_and_cpu` and
`mirrored_strategy_with_two_cpus` combinations stand for, and TF's `tf_function`
combination (the same code run eagerly and inside gd.function)."""

from __future__ import annotations

import pytest

import graphdist as gd

TWO = ("cpu:0", "cpu:1")


@pytest.fixture
def strategy():
    return gd.MirroredStrategy(list(TWO))


@pytest.fixture(params=["eager", "function"])
def tf_function(request):
    """TF's combinations.tf_function / no_tf_function: wrap a callable in gd.function, or not."""
    return gd.function if request.param == "function" else (lambda fn: fn)
