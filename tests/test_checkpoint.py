"""Tests for gd.Checkpoint: object paths, optimizer state (slots made on restore), sync-on-read
values across replica counts, validation before any write, and atomic saves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from graphdist.checkpoint import Checkpoint

DEV4 = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
ON_READ = gd.VariableSynchronization.ON_READ


class Dense:
    def __init__(self, n_in, n_out, seed):
        rng = np.random.default_rng(seed)
        self.w = gd.Variable(rng.normal(size=(n_in, n_out)).astype(np.float32), name="w")
        self.b = gd.Variable(np.zeros(n_out, np.float32), name="b")


class Model:
    def __init__(self, seed=0):
        self.dense1 = Dense(3, 4, seed)
        self.dense2 = Dense(4, 2, seed + 1)
        self.extras = [gd.Variable(np.int64(7), name="count")]
        self.label = "not a variable"

    def __call__(self, x):
        return gd.relu(x @ self.dense1.w + self.dense1.b) @ self.dense2.w + self.dense2.b

    @property
    def trainable(self):
        return [self.dense1.w, self.dense1.b, self.dense2.w, self.dense2.b]


def _train_step(model, opt):
    @gd.function
    def step(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable)
        opt.apply_gradients(zip(grads, model.trainable))
        return loss

    return step


def _data():
    rng = np.random.default_rng(42)
    return rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)


def _snapshot(ckpt):
    return {k: [c.copy() for c in v.values] for k, v in ckpt._entries()[0].items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=k)


# ---------------------------------------------------------------- paths and round trips


def test_object_paths_and_file_format(tmp_path):
    model, opt = Model(), gd.optimizers.Adam(0.01)
    x, y = _data()
    _train_step(model, opt)(x, y)
    inner = Checkpoint(v=gd.Variable(np.ones(2, np.float32)))
    ckpt = Checkpoint(model=model, opt=opt, more={"a/b": inner})
    path = str(tmp_path / "ckpt.npz")
    assert ckpt.save(path) == path
    assert ckpt.model is model and ckpt.opt is opt
    with np.load(path, allow_pickle=False) as f:        # a plain npz, no pickle
        keys = set(f.files)
        meta = json.loads(f["__meta__"].tobytes())
    weights = {f"model/dense{i}/{n}" for i in (1, 2) for n in ("w", "b")}
    slots = {f"opt/slots/{w}/{s}" for w in weights for s in ("m", "v")}
    hyper = {f"opt/hyper/{h}" for h in ("learning_rate", "beta_1", "beta_2", "epsilon")}
    assert keys == weights | slots | hyper | {"model/extras/0", "opt/iterations",
                                              "more/a%2Fb/v", "__meta__"}
    assert meta["version"] == 1
    assert meta["entries"]["model/dense1/w"] == {
        "shape": [3, 4], "dtype": "float32", "synchronization": "auto", "aggregation": "none",
        "components": 1}
    assert meta["entries"]["opt/iterations"]["dtype"] == "int64"


def test_restore_overwrites_values(tmp_path):
    model = Model()
    ckpt = Checkpoint(model=model)
    saved = _snapshot(ckpt)
    path = ckpt.save(tmp_path / "c.npz")
    model.dense1.w.assign(np.zeros((3, 4), np.float32))
    model.extras[0].assign(np.int64(-1))
    ckpt.restore(path)
    _assert_same(_snapshot(ckpt), saved)


def test_adam_state_round_trip_is_bit_exact(tmp_path):
    x, y = _data()
    model, opt = Model(seed=0), gd.optimizers.Adam(learning_rate=0.05)
    step = _train_step(model, opt)
    for _ in range(3):
        step(x, y)
    path = Checkpoint(model=model, opt=opt).save(tmp_path / "adam.npz")

    model2, opt2 = Model(seed=5), gd.optimizers.Adam(learning_rate=0.05)
    ckpt2 = Checkpoint(model=model2, opt=opt2)
    assert opt2.slots() == {}
    ckpt2.restore(path)                      # slots do not exist yet: restore makes them
    assert len(opt2._slots) == 8 and int(opt2.iterations.numpy()) == 3
    step2 = _train_step(model2, opt2)
    for _ in range(3):
        assert step(x, y) == step2(x, y)
    assert int(opt2.iterations.numpy()) == 6
    _assert_same(_snapshot(Checkpoint(model=model2, opt=opt2)),
                 _snapshot(Checkpoint(model=model, opt=opt)))


def test_restore_into_existing_slots_and_slots_saved_before_they_existed(tmp_path):
    x, y = _data()
    model, opt = Model(), gd.optimizers.Adam(learning_rate=0.05)
    ckpt = Checkpoint(model=model, opt=opt)
    fresh = _snapshot(ckpt)
    before = ckpt.save(tmp_path / "before.npz")           # no slots yet
    step = _train_step(model, opt)
    step(x, y)
    trained = _snapshot(ckpt)
    after = ckpt.save(tmp_path / "after.npz")
    step(x, y)
    ckpt.restore(after)                                    # existing slots are overwritten
    _assert_same(_snapshot(ckpt), trained)
    ckpt.restore(before)                                   # slots it lacks go back to zeros
    state = _snapshot(ckpt)
    assert all(not np.any(state[k][0]) for k in state if "/slots/" in k)
    _assert_same({k: v for k, v in state.items() if "/slots/" not in k}, fresh)


def test_slots_of_untracked_variables_are_not_saved(tmp_path):
    w = gd.Variable(np.ones(2, np.float32))
    opt = gd.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    path = Checkpoint(opt=opt).save(tmp_path / "c.npz")
    with np.load(path) as f:
        assert set(f.files) == {"opt/iterations", "__meta__", "opt/hyper/learning_rate",
                                "opt/hyper/momentum", "opt/hyper/weight_decay"}
    Checkpoint(opt=opt).restore(path)
    assert int(opt.iterations.numpy()) == 1


def test_hyperparameters_are_saved_and_restored_into_a_compiled_step(tmp_path):
    w = gd.Variable(np.zeros(2))
    opt = gd.optimizers.SGD(0.1, momentum=0.9)
    opt.learning_rate, opt.momentum = 0.05, 0.5
    path = Checkpoint(w=w, opt=opt).save(tmp_path / "c.npz")
    w2 = gd.Variable(np.zeros(2))
    fresh = gd.optimizers.SGD(0.1, momentum=0.9)
    step = gd.function(lambda: fresh.apply_gradients([(gd.ones_like(w2), w2)]))
    step()                                                 # traced with lr 0.1, momentum 0.9
    Checkpoint(w=w2, opt=fresh).restore(path)              # w 0, iterations 0, the slot 0
    assert float(fresh.learning_rate.numpy()) == 0.05 and float(fresh.momentum.numpy()) == 0.5
    step()
    np.testing.assert_allclose(fresh.slot(w2, "momentum").numpy(), [1.0, 1.0])
    np.testing.assert_allclose(w2.numpy(), [-0.05, -0.05])     # lr 0.05 (0.1 would be -0.1)
    step()                                                 # m = 0.5 * 1 + 1 (0.9 gives 1.9)
    np.testing.assert_allclose(w2.numpy(), [-0.05 - 0.05 * 1.5] * 2)
    assert step.trace_count == 1


def test_a_checkpoint_from_before_hyperparameter_state_keeps_constructor_values(tmp_path):
    from graphdist.checkpoint_format import META, write_atomically

    w = gd.Variable(np.ones(2))
    opt = gd.optimizers.Adam(0.01)
    opt.apply_gradients([(np.ones(2), w)])
    path = Checkpoint(w=w, opt=opt).save(tmp_path / "new.npz")
    with np.load(path) as f:                               # the same file, minus opt/hyper/*
        arrays = {k: f[k] for k in f.files if not k.startswith("opt/hyper/")}
    meta = json.loads(arrays[META].tobytes())
    meta["entries"] = {k: e for k, e in meta["entries"].items() if "/hyper/" not in k}
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    old = str(tmp_path / "old.npz")
    write_atomically(old, arrays)
    w2 = gd.Variable(np.zeros(2))
    opt2 = gd.optimizers.Adam(0.002, beta_1=0.5)
    Checkpoint(w=w2, opt=opt2).restore(old)
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert int(opt2.iterations.numpy()) == 1
    assert float(opt2.learning_rate.numpy()) == 0.002 and float(opt2.beta_1.numpy()) == 0.5
    Checkpoint(w=w2, opt=opt2).restore(path)               # a new file brings them along
    assert float(opt2.learning_rate.numpy()) == 0.01 and float(opt2.beta_1.numpy()) == 0.9


def test_entries_nothing_tracks_are_ignored(tmp_path):
    a, b = gd.Variable(np.arange(3.0)), gd.Variable(np.float32(2.0))
    opt = gd.optimizers.SGD(0.1, momentum=0.5)
    opt.apply_gradients([(np.ones(3), a)])
    path = Checkpoint(a=a, b=b, opt=opt).save(tmp_path / "c.npz")
    a2 = gd.Variable(np.zeros(3))
    opt2 = gd.optimizers.SGD(0.1, momentum=0.5)
    Checkpoint(a=a2, opt=opt2).restore(path)               # b and nothing else: fine
    np.testing.assert_array_equal(a2.numpy(), a.numpy())
    np.testing.assert_array_equal(opt2.slot(a2, "momentum").numpy(),
                                  opt.slot(a, "momentum").numpy())
    opt3 = gd.optimizers.SGD(0.1, momentum=0.5)
    Checkpoint(opt=opt3).restore(path)                     # the slots' variable is untracked
    assert opt3.slots() == {} and int(opt3.iterations.numpy()) == 1


# ---------------------------------------------------------------- replicas


def _replicated(value, devices, sync=gd.VariableSynchronization.AUTO, agg="none"):
    return gd.Variable(value, synchronization=sync, aggregation=agg, _devices=devices)


@pytest.mark.parametrize("n", [4, 2, 1])
def test_sync_on_read_and_mirrored_restore_into_fewer_replicas(tmp_path, n):
    src = {
        "sum": _replicated(np.float32(0), DEV4, ON_READ, "sum"),
        "mean": _replicated(np.zeros(2), DEV4, ON_READ, "mean"),
        "first": _replicated(np.float32(0), DEV4, ON_READ, "only_first_replica"),
        "isum": _replicated(np.int64(0), DEV4, ON_READ, "sum"),
        "mirrored": _replicated(np.zeros(3, np.float32), DEV4),
    }
    src["sum"].assign_components([np.float32(v) for v in (1, 2, 3, 6)])       # reads 12
    src["mean"].assign_components([np.array([v, -v]) for v in (1.0, 2.0, 3.0, 6.0)])
    src["first"].assign_components([np.float32(v) for v in (5, 9, 9, 9)])     # reads 5
    src["isum"].assign_components([np.int64(v) for v in (1, 2, 3, 5)])        # reads 11
    src["mirrored"].assign(np.arange(3, dtype=np.float32))
    path = Checkpoint(**src).save(tmp_path / "r4.npz")
    with np.load(path) as f:
        assert f["sum"] == 12 and f["isum"] == 11 and f["first"] == 5
        np.testing.assert_array_equal(f["mean"], [3.0, -3.0])
        assert f["mirrored"].shape == (3,)                 # saved once, not per replica

    dev = DEV4[:n]
    dst = {k: _replicated(np.zeros_like(v.numpy()), dev, v.synchronization, v.aggregation)
           for k, v in src.items()}
    Checkpoint(**dst).restore(path)
    assert len(dst["sum"].values) == n and dst["sum"].numpy() == 12
    assert [list(c) for c in dst["mean"].values] == [[3.0, -3.0]] * n
    assert [float(c) for c in dst["first"].values] == [5.0] * n
    assert sum(int(c) for c in dst["isum"].values) == 11 and dst["isum"].numpy() == 11
    assert [list(c) for c in dst["mirrored"].values] == [[0.0, 1.0, 2.0]] * n
    for k, var in src.items():
        np.testing.assert_array_equal(dst[k].numpy(), var.numpy(), err_msg=k)


def test_slots_restored_as_mirrored_on_every_replica(tmp_path):
    w = _replicated(np.ones(2, np.float32), DEV4[:2])
    opt = gd.optimizers.SGD(0.1, momentum=0.9)
    opt.slot(w, "momentum").assign(np.array([1.5, -2.0], np.float32))
    path = Checkpoint(w=w, opt=opt).save(tmp_path / "c.npz")
    w4 = _replicated(np.ones(2, np.float32), DEV4)
    opt4 = gd.optimizers.SGD(0.1, momentum=0.9)
    Checkpoint(w=w4, opt=opt4).restore(path)
    m = opt4.slot(w4, "momentum")
    assert len(m.values) == 4 and all(list(c) == [1.5, -2.0] for c in m.values)


# ---------------------------------------------------------------- errors change nothing


def _three(dtype=np.float32, shape=(2,)):
    return {"a": gd.Variable(np.full(3, 1.0, np.float32)),
            "b": gd.Variable(np.int32(4)),
            "c": gd.Variable(np.zeros(shape, dtype))}


def _truncate(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:len(data) // 2])


def _flip_a_data_byte(path):
    data = bytearray(Path(path).read_bytes())
    at = data.find(np.full(3, 1.0, np.float32).tobytes())    # a's array bytes
    assert at > 0
    data[at + 5] ^= 0x10
    Path(path).write_bytes(bytes(data))


BAD_FILES = {
    "missing": (lambda p: os.remove(p), None, ["no such checkpoint file"]),
    "truncated": (_truncate, None, ["truncated or corrupt"]),
    "corrupt": (_flip_a_data_byte, None, ["truncated or corrupt"]),
    "absent": (None, {"d": np.zeros(1)}, ["'d'", "absent"]),
    "shape": (None, {"c": np.zeros((2, 3), np.float32)}, ["'c'", "(2, 3)", "(2,)"]),
    "dtype": (None, {"c": np.zeros(2, np.float64)}, ["'c'", "float64", "float32"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_raises_and_changes_nothing(tmp_path, case):
    damage, extra, words = BAD_FILES[case]
    saved = _three()
    path = Checkpoint(**saved).save(str(tmp_path / "c.npz"))
    if damage:
        damage(path)
    live = _three()
    for k, v in live.items():                              # differs from the file everywhere
        v.assign(saved[k].numpy() + 1)
    if extra:
        live.update({k: gd.Variable(v) for k, v in extra.items()})   # the last entry is bad
    before = {k: v.numpy() for k, v in live.items()}
    with pytest.raises(gd.CheckpointError) as err:
        Checkpoint(**live).restore(path)
    assert isinstance(err.value, ValueError)
    for word in [path, *words]:
        assert word in str(err.value)
    for k, v in live.items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


def test_failed_restore_creates_no_slots(tmp_path):
    w = gd.Variable(np.ones(2, np.float32))
    opt = gd.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    path = Checkpoint(w=w, opt=opt, z=gd.Variable(np.ones(2))).save(tmp_path / "c.npz")
    w2, opt2 = gd.Variable(np.zeros(2, np.float32)), gd.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(gd.CheckpointError, match="entry 'z'"):
        Checkpoint(w=w2, opt=opt2, z=gd.Variable(np.ones(3))).restore(path)
    assert opt2.slots() == {} and int(opt2.iterations.numpy()) == 0
    assert not np.any(w2.numpy())


def test_newer_format_and_foreign_npz(tmp_path):
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.ones(2))
    with pytest.raises(gd.CheckpointError, match="not a graphdist checkpoint"):
        Checkpoint(x=gd.Variable(np.ones(2))).restore(foreign)
    meta = {"format": "graphdist.checkpoint", "version": 99, "entries": {}}
    newer = tmp_path / "newer.npz"
    np.savez(newer, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    with pytest.raises(gd.CheckpointError, match="version 99"):
        Checkpoint().restore(newer)


def test_non_trackable_arguments():
    with pytest.raises(TypeError, match="'lr'"):
        Checkpoint(lr=0.1)
    with pytest.raises(TypeError, match="ndarray"):
        Checkpoint(w=np.ones(2))
    with pytest.raises(ValueError, match="reserved"):
        Checkpoint(__meta__=gd.Variable(1.0))


def test_save_inside_a_trace_raises(tmp_path):
    v = gd.Variable(np.float32(1))
    ckpt = Checkpoint(v=v)

    @gd.function
    def f(x):
        ckpt.save(tmp_path / "x.npz")
        return x

    with pytest.raises(gd.TraceError, match="traced code"):
        f(np.float32(1))


# ---------------------------------------------------------------- atomic writes


def _listing(tmp_path):
    return sorted(os.listdir(tmp_path))


def test_save_leaves_no_temp_files_and_replaces(tmp_path):
    v = gd.Variable(np.float32(1))
    ckpt = Checkpoint(v=v)
    path = str(tmp_path / "c.npz")
    ckpt.save(path)
    v.assign(np.float32(2))
    ckpt.save(path)
    assert _listing(tmp_path) == ["c.npz"]
    with np.load(path) as f:
        assert f["v"] == 2


KILLED_SAVE = """
import os, sys
import numpy as np
import graphdist as gd
from graphdist.checkpoint import Checkpoint
os.replace = lambda *a: os._exit(9)     # killed after writing its temp file, before the rename
Checkpoint(v=gd.Variable(np.full(3, 7.0))).save(sys.argv[1])
"""


def test_a_killed_saves_temp_file_is_removed_by_the_next_save(tmp_path):
    import subprocess
    import sys
    import time

    from graphdist import checkpoint

    path = str(tmp_path / "c.npz")
    ckpt = Checkpoint(v=gd.Variable(np.arange(3.0)))
    ckpt.save(path)
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, path], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    [left] = [n for n in _listing(tmp_path) if n != "c.npz"]
    assert left.startswith(".c.npz.") and left.endswith(".tmp")
    with np.load(path) as f:                       # the checkpoint itself stayed whole
        np.testing.assert_array_equal(f["v"], np.arange(3.0))
    host, mine = checkpoint._HOST, os.getpid()
    keep = [f".c.npz.{host}.{mine}.0123abcd.tmp",          # a concurrent save in a live process
            ".c.npz.otherhost.12345.89abcdef.tmp",         # another host's, recent
            ".d.npz.otherhost.1.0123abcd.tmp",            # another checkpoint's
            f".d.npz.{host}.999999999.0123abcd.tmp",      # (even of a dead process)
            "c.npz.0123abcd.tmp", ".c.npz.notes.txt"]      # not temp names of c.npz
    old = [".c.npz.0a1b2c3d.tmp", ".c.npz.otherhost.12345.deadbeef.tmp"]  # untouched too long
    for name in keep + old:
        (tmp_path / name).write_bytes(b"partial")
    stale = time.time() - checkpoint.STALE_TEMP_S - 60
    for name in old:
        os.utime(tmp_path / name, (stale, stale))
    ckpt.save(path)
    assert _listing(tmp_path) == sorted(keep + ["c.npz"])
    ckpt.restore(path)
    np.testing.assert_array_equal(ckpt.v.numpy(), np.arange(3.0))


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_failed_save_keeps_the_old_checkpoint(tmp_path, monkeypatch, where):
    v = gd.Variable(np.arange(4.0))
    ckpt = Checkpoint(v=v, w=gd.Variable(np.float32(3)))
    path = str(tmp_path / "c.npz")
    ckpt.save(path)
    old = Path(path).read_bytes()
    v.assign(np.zeros(4))

    def boom(*args, **kwargs):
        raise OSError(f"simulated failure in {where}")

    if where == "write":                        # fails after the first entry was written
        real = np.lib.format.write_array
        calls = []

        def write_array(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                boom()
            return real(*args, **kwargs)

        monkeypatch.setattr(np.lib.format, "write_array", write_array)
    else:
        monkeypatch.setattr(os, where, boom)
    with pytest.raises(OSError, match="simulated"):
        ckpt.save(path)
    monkeypatch.undo()
    assert _listing(tmp_path) == ["c.npz"]
    assert Path(path).read_bytes() == old
    ckpt.restore(path)
    np.testing.assert_array_equal(v.numpy(), np.arange(4.0))


def test_mirrored_training_checkpoint_restores_onto_fewer_replicas(tmp_path):
    """Train on 4 replicas, save, restore into a fresh model and optimizer on 2 replicas and
    on 1 device: the next steps match continuing on 4 (equal shards, mean gradients)."""
    import graphdist as gd

    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 3)).astype(np.float32)
    w0 = rng.standard_normal((8, 3)).astype(np.float32)

    def build(n):
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
        with strategy.scope():
            w = gd.Variable(w0, name="w")
            seen = gd.Variable(0.0, name="seen",
                               synchronization=gd.VariableSynchronization.ON_READ,
                               aggregation=gd.VariableAggregation.SUM)
            opt = gd.optimizers.Adam(0.05)

        @gd.function
        def step(batch):
            def replica_fn(xb, yb):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean((xb @ w - yb) ** 2.0)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
                seen.assign_add(gd.cast(gd.shape(xb)[0], "float32"))
                return loss
            return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        return (lambda: step(batch)), w, seen, opt

    step4, w4, seen4, opt4 = build(4)
    for _ in range(3):
        step4()
    path = Checkpoint(w=w4, seen=seen4, opt=opt4).save(tmp_path / "ckpt.npz")
    assert seen4.numpy() == 48.0                      # 3 steps x 16 examples, summed
    for n in (2, 1):
        step_n, w_n, seen_n, opt_n = build(n)
        Checkpoint(w=w_n, seen=seen_n, opt=opt_n).restore(path)
        np.testing.assert_array_equal(w_n.numpy(), w4.numpy())
        assert seen_n.numpy() == 48.0 and len(seen_n.values) == n
        assert int(opt_n.iterations.numpy()) == 3
        step_n()
    reference = [c.copy() for c in w4.values]
    step4()
    np.testing.assert_allclose(w_n.numpy(), w4.numpy(), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(reference[0], w4.values[0])
