"""model.save_weights / load_weights: .safetensors files (read back by the safetensors
package itself) and the checkpoint format, across replica counts; untrusted files give
gd.CheckpointError naming the file and the entry, change nothing, and run no code."""

import importlib.util
import os
import pickle
import sys

import numpy as np
import pytest

import graphdist as gd

HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(not HAVE_SAFETENSORS, reason="the safetensors extra "
                                       "is not installed: pip install 'graphdist[safetensors]'")
if HAVE_SAFETENSORS:
    import safetensors.numpy

X = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)


def _strategy(n):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


class Net(gd.nn.Model):
    def __init__(self, units=3):
        super().__init__()
        self.hidden = gd.nn.Dense(units, activation="relu")
        self.norm = gd.nn.BatchNorm()
        self.out = gd.nn.Dense(2)

    def call(self, x, training=False):
        return self.out(self.norm(self.hidden(x), training=training))


def _built(n=1, units=3):
    with _strategy(n).scope():
        model = Net(units)
        model(X)
    return model


@pytest.mark.parametrize("suffix", [pytest.param(".safetensors", marks=needs_safetensors),
                                    ".npz"])
def test_round_trip_across_replica_counts(tmp_path, suffix):
    source = _built(4)
    path = str(tmp_path / f"w{suffix}")
    assert source.save_weights(path) == path
    target = _built(1)
    target.load_weights(path)
    for a, b in zip(target.get_weights(), source.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(target.predict(X), source.predict(X))


@needs_safetensors
def test_the_file_is_plain_safetensors(tmp_path):
    model = _built()
    path = str(tmp_path / "w.safetensors")
    model.save_weights(path)
    tensors = safetensors.numpy.load_file(path)
    assert sorted(tensors) == ["hidden/bias", "hidden/kernel", "norm/beta", "norm/gamma",
                               "norm/moving_mean", "norm/moving_variance", "out/bias",
                               "out/kernel"]
    np.testing.assert_array_equal(tensors["hidden/kernel"], model.hidden.kernel.numpy())
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def _unchanged(model, before):
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def _write(path, tensors):
    safetensors.numpy.save_file(tensors, str(path))
    return str(path)


@needs_safetensors
def test_files_that_do_not_fit_are_refused_naming_the_entry(tmp_path):
    model = _built()
    good = str(tmp_path / "w.safetensors")
    model.save_weights(good)
    tensors = safetensors.numpy.load_file(good)
    before = model.get_weights()

    bad_shape = dict(tensors, **{"out/kernel": np.zeros((4, 2), np.float32)})
    with pytest.raises(gd.CheckpointError, match=r"bad_shape.*'out/kernel'.*\[4, 2\]"):
        model.load_weights(_write(tmp_path / "bad_shape.safetensors", bad_shape))
    bad_dtype = dict(tensors, **{"out/bias": tensors["out/bias"].astype(np.float64)})
    with pytest.raises(gd.CheckpointError, match="'out/bias' is float64"):
        model.load_weights(_write(tmp_path / "bad_dtype.safetensors", bad_dtype))
    missing = {k: v for k, v in tensors.items() if k != "norm/gamma"}
    with pytest.raises(gd.CheckpointError, match="missing.*norm/gamma"):
        model.load_weights(_write(tmp_path / "missing.safetensors", missing))
    extra = dict(tensors, **{"head/kernel": np.zeros(1, np.float32)})
    with pytest.raises(gd.CheckpointError, match="not in the model.*head/kernel"):
        model.load_weights(_write(tmp_path / "extra.safetensors", extra))
    _unchanged(model, before)


@needs_safetensors
def test_corrupt_and_missing_files(tmp_path):
    model = _built()
    before = model.get_weights()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 8 + b"{not json")
    with pytest.raises(gd.CheckpointError, match="garbage.safetensors: not a readable"):
        model.load_weights(str(garbage))
    truncated = tmp_path / "truncated.safetensors"
    model.save_weights(str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with pytest.raises(gd.CheckpointError, match="truncated.safetensors"):
        model.load_weights(str(truncated))
    with pytest.raises(gd.CheckpointError, match="no such weights file"):
        model.load_weights(str(tmp_path / "absent.safetensors"))
    _unchanged(model, before)


class _Payload:
    def __reduce__(self):
        return (open, (os.environ["GD_TEST_MARKER"], "w"))


def test_a_pickle_is_never_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("GD_TEST_MARKER", str(marker))
    model = _built()
    for suffix in (".safetensors", ".npz") if HAVE_SAFETENSORS else (".npz",):
        path = tmp_path / f"evil{suffix}"
        path.write_bytes(pickle.dumps(_Payload()))
        with pytest.raises(gd.CheckpointError):
            model.load_weights(str(path))
    assert not marker.exists()


@needs_safetensors
def test_another_architecture_is_refused(tmp_path):
    path = str(tmp_path / "w.safetensors")
    _built(units=3).save_weights(path)
    with pytest.raises(gd.CheckpointError, match="'hidden/kernel' is float32\\[5, 3\\]"):
        _built(units=4).load_weights(path)


@needs_safetensors
def test_an_unbuilt_model_says_to_call_it_first(tmp_path):
    path = str(tmp_path / "w.safetensors")
    _built().save_weights(path)
    with pytest.raises(gd.CheckpointError, match="call the model once"):
        Net().load_weights(path)


def test_without_the_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    model = _built()
    with pytest.raises(ImportError, match=r"pip install 'graphdist\[safetensors\]'"):
        model.save_weights(str(tmp_path / "w.safetensors"))
    model.save_weights(str(tmp_path / "w.npz"))         # the checkpoint format needs nothing
