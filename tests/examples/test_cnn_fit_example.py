"""examples/cnn_digits_fit.py, TF's distributed-training tutorial re-created with Model.fit:
it learns the digits, 4 replicas train the same model as one device, and its checkpoints
are the per-epoch weights (the backup is removed once fit completes)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from graphdist.examples import cnn_digits_fit


@pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                    reason="the example saves .safetensors weights: the safetensors extra")
def test_fit_reaches_97_percent_held_out_on_one_and_four_devices(tmp_path):
    one = cnn_digits_fit.train(1, epochs=12)
    four = cnn_digits_fit.train(4, epochs=12, checkpoints=str(tmp_path))
    assert one["accuracy"] >= 0.97 and four["accuracy"] >= 0.97
    assert four["history"]["val_accuracy"][-1] == four["accuracy"]
    np.testing.assert_allclose(one["history"]["loss"], four["history"]["loss"], rtol=1e-3)
    for a, b in zip(one["model"].get_weights(), four["model"].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    assert sorted(os.listdir(tmp_path)) == [f"weights-{e:02d}.safetensors" for e in range(1, 13)]
    reloaded = cnn_digits_fit.compiled_model(four["strategy"])
    reloaded(np.zeros((1, 8, 8, 1), np.float32))      # build, then load
    reloaded.load_weights(str(tmp_path / "weights-12.safetensors"))
    for a, b in zip(reloaded.get_weights(), four["model"].get_weights()):
        np.testing.assert_array_equal(a, b)
