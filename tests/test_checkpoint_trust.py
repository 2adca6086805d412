"""Checkpoints that must not be trusted blindly: another optimizer's state, what a restore
reports (its status), sync-on-read values across replica counts, and files that are
malformed or hostile (zip bombs, huge declared shapes, FIFOs, malformed metadata)."""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

import graphdist as gd
from graphdist.checkpoint import Checkpoint

META = "__meta__.npy"


def _trained(opt, steps=2, seed=0):
    """A variable `w` and `opt` after `steps` eager updates."""
    w = gd.Variable(np.random.default_rng(seed).normal(size=3).astype(np.float32), name="w")
    for _ in range(steps):
        opt.apply_gradients([(np.full(3, 0.5, np.float32), w)])
    return w, opt


def _state(ckpt):
    return {k: [np.array(c) for c in v.values] for k, v in ckpt._entries()[0].items()}


def _assert_unchanged(ckpt, before):
    after = _state(ckpt)
    assert after.keys() == before.keys()          # no slot made either
    for key, values in before.items():
        for x, y in zip(values, after[key], strict=True):
            np.testing.assert_array_equal(x, y, err_msg=key)


# ---------------------------------------------------------------- raw files


def _members(path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def _npy_raw(descr, shape, data=b"", fortran=False, version=b"\x01\x00") -> bytes:
    """A .npy file with any header at all (what a hostile writer can produce)."""
    header = repr({"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    header += " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY" + version + struct.pack("<H", len(header)) + header.encode() + data


def _meta(members) -> dict:
    return json.loads(np.lib.format.read_array(io.BytesIO(members[META])).tobytes())


def _meta_npy(meta) -> bytes:
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return _npy(np.frombuffer(raw, np.uint8))


def _write_zip(path, items, compression=zipfile.ZIP_STORED):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)         # "Duplicate name"
        with zipfile.ZipFile(path, "w", compression) as zf:
            for name, data in items:
                zf.writestr(name, data)
    return str(path)


# ---------------------------------------------------------------- item 1: optimizer types


def test_the_metadata_records_each_optimizers_type_and_slot_names(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1))
    sgd = gd.optimizers.SGD(0.1)
    path = Checkpoint(w=w, opt=adam, plain=sgd).save(tmp_path / "c.npz")
    assert _meta(_members(path))["optimizers"] == {
        "opt": {"type": "Adam", "slots": ["m", "v"]},
        "plain": {"type": "SGD", "slots": []}}


def test_an_sgd_checkpoint_into_a_trained_adam_raises_naming_both_types(tmp_path):
    w, sgd = _trained(gd.optimizers.SGD(0.1, momentum=0.9))
    path = Checkpoint(w=w, opt=sgd).save(tmp_path / "sgd.npz")
    w2, adam = _trained(gd.optimizers.Adam(0.01), seed=1)
    ckpt = Checkpoint(w=w2, opt=adam)
    before = _state(ckpt)
    with pytest.raises(gd.CheckpointError) as err:
        ckpt.restore(path)
    for word in (str(path), "SGD", "Adam", "'opt'", "opt/slots/w/momentum", "opt/hyper/momentum"):
        assert word in str(err.value)
    _assert_unchanged(ckpt, before)


def test_an_adam_checkpoint_does_not_replace_sgds_learning_rate(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.5))
    path = Checkpoint(w=w, opt=adam).save(tmp_path / "adam.npz")
    w2 = gd.Variable(np.zeros(3, np.float32), name="w")
    sgd = gd.optimizers.SGD(0.01)
    ckpt = Checkpoint(w=w2, opt=sgd)
    with pytest.raises(gd.CheckpointError, match=r"Adam.*SGD|SGD.*Adam"):
        ckpt.restore(path)
    assert float(sgd.learning_rate.numpy()) == 0.01 and int(sgd.iterations.numpy()) == 0
    assert sgd.slots() == {} and not np.any(w2.numpy())


def test_adamw_and_adam_are_different_optimizers(tmp_path):
    w, adamw = _trained(gd.optimizers.AdamW(0.1))
    path = Checkpoint(w=w, opt=adamw).save(tmp_path / "adamw.npz")
    with pytest.raises(gd.CheckpointError, match="AdamW"):
        Checkpoint(w=gd.Variable(np.zeros(3, np.float32)), opt=gd.optimizers.Adam()).restore(path)


@pytest.mark.parametrize("saved, restored", [(0.9, 0.0), (0.0, 0.9)])
def test_sgd_with_and_without_momentum_are_different_state(tmp_path, saved, restored):
    """Same type, other slots: momentum buffers restored into an SGD that never reads
    them, or a trained SGD's missing momentum silently started from zeros."""
    w, trained = _trained(gd.optimizers.SGD(0.1, momentum=saved))
    path = Checkpoint(w=w, opt=trained).save(tmp_path / "sgd.npz")
    w2 = gd.Variable(np.zeros(3, np.float32), name="w")
    sgd = gd.optimizers.SGD(0.1, momentum=restored)
    ckpt = Checkpoint(w=w2, opt=sgd)
    before = _state(ckpt)
    with pytest.raises(gd.CheckpointError, match=r"keeps the slots .* here keeps"):
        ckpt.restore(path)
    _assert_unchanged(ckpt, before)
    # the same settings restore
    same = gd.optimizers.SGD(0.1, momentum=saved)
    Checkpoint(w=gd.Variable(np.zeros(3, np.float32), name="w"), opt=same).restore(
        path).assert_consumed()
    assert int(same.iterations.numpy()) == int(trained.iterations.numpy())


def _without(path, out, drop=(), meta_fn=None):
    """A copy of checkpoint `path` without the entries `drop` (and its metadata edited)."""
    members = _members(path)
    meta = _meta(members)
    for key in drop:
        del members[f"{key}.npy"]
        del meta["entries"][key]
    if meta_fn is not None:
        meta_fn(meta)
    members[META] = _meta_npy(meta)
    return _write_zip(out, members.items())


def test_a_missing_adam_slot_of_an_optimizer_that_took_steps_raises(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1), steps=3)
    path = Checkpoint(w=w, opt=adam).save(tmp_path / "c.npz")
    damaged = _without(path, tmp_path / "no_v.npz", drop=["opt/slots/w/v"])
    fresh = (gd.Variable(np.zeros(3, np.float32), name="w"), gd.optimizers.Adam(0.1))
    for w2, live in (fresh, _trained(gd.optimizers.Adam(0.1), seed=4)):   # no slots / slots
        ckpt = Checkpoint(w=w2, opt=live)
        before = _state(ckpt)
        with pytest.raises(gd.CheckpointError) as err:
            ckpt.restore(damaged)
        for word in ("opt/slots/w/v", "3 steps", "Adam"):
            assert word in str(err.value)
        _assert_unchanged(ckpt, before)


def test_all_slots_missing_after_steps_raises_but_before_the_first_step_they_are_zeros(
        tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1), steps=2)
    ckpt = Checkpoint(w=w, opt=adam)
    trained = ckpt.save(tmp_path / "trained.npz")
    no_slots = _without(trained, tmp_path / "no_slots.npz",
                        drop=["opt/slots/w/m", "opt/slots/w/v"])
    with pytest.raises(gd.CheckpointError, match="opt/slots/w/m"):
        ckpt.restore(no_slots)                         # adam has slots; the file took 2 steps
    fresh = Checkpoint(w=gd.Variable(np.zeros(3, np.float32)), opt=gd.optimizers.Adam(0.1))
    before = fresh.save(tmp_path / "before.npz")       # 0 steps, no slots: nothing missing
    status = ckpt.restore(before)
    assert all(not np.any(s.numpy()) for s in adam._slots.values())
    with pytest.raises(gd.CheckpointError, match="opt/slots/w/m"):
        status.assert_consumed()                       # zeroed, not restored: it says so


def test_an_older_checkpoint_without_types_is_checked_by_its_entry_names(tmp_path):
    def untyped(meta):
        del meta["optimizers"]

    w, sgd = _trained(gd.optimizers.SGD(0.1, momentum=0.9))
    path = Checkpoint(w=w, opt=sgd).save(tmp_path / "sgd.npz")
    old = _without(path, tmp_path / "old.npz", meta_fn=untyped)
    with pytest.raises(gd.CheckpointError, match="beta_1"):         # names differ: refused
        Checkpoint(w=gd.Variable(np.zeros(3, np.float32), name="w"),
                   opt=gd.optimizers.Adam()).restore(old)
    w2, sgd2 = gd.Variable(np.zeros(3, np.float32)), gd.optimizers.SGD(0.5, momentum=0.5)
    Checkpoint(w=w2, opt=sgd2).restore(old).assert_consumed()        # the same kind: restores
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    np.testing.assert_array_equal(sgd2.slot(w2, "momentum").numpy(),
                                  sgd.slot(w, "momentum").numpy())
    assert float(sgd2.learning_rate.numpy()) == 0.1 and int(sgd2.iterations.numpy()) == 2


# ---------------------------------------------------------------- item 2: the status


def test_a_complete_restore_is_consumed(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1))
    path = Checkpoint(w=w, opt=adam).save(tmp_path / "c.npz")
    w2, adam2 = gd.Variable(np.zeros(3, np.float32)), gd.optimizers.Adam(0.1)
    status = Checkpoint(w=w2, opt=adam2).restore(path)
    assert status.assert_consumed() is status                 # slots made at once: none pending
    assert status.assert_existing_objects_matched() is status
    assert len(adam2._slots) == 2


def test_a_partial_restore_names_what_was_not_used(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1))
    extra = gd.Variable(np.ones(2), name="extra")
    path = Checkpoint(w=w, opt=adam, extra=extra).save(tmp_path / "c.npz")
    w2 = gd.Variable(np.zeros(3, np.float32))
    status = Checkpoint(w=w2).restore(path)
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert status.assert_existing_objects_matched() is status   # everything tracked: restored
    with pytest.raises(gd.CheckpointError) as err:
        status.assert_consumed()
    for word in (str(path), "'extra'", "'opt/iterations'", "'opt/slots/w/m'"):
        assert word in str(err.value)
    assert "'w'" not in str(err.value)
    assert status.expect_partial() is status


def test_a_value_the_file_does_not_have_is_not_matched(tmp_path):
    w, adam = _trained(gd.optimizers.Adam(0.1))
    path = Checkpoint(w=w, opt=adam).save(tmp_path / "c.npz")
    old = _without(path, tmp_path / "old.npz", drop=["opt/hyper/learning_rate"])
    adam2 = gd.optimizers.Adam(0.25)
    status = Checkpoint(w=gd.Variable(np.zeros(3, np.float32)), opt=adam2).restore(old)
    assert float(adam2.learning_rate.numpy()) == 0.25          # kept, as documented
    for check in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(gd.CheckpointError, match="'opt/hyper/learning_rate'"):
            check()


def test_a_partial_restore_left_unchecked_logs_once_unless_expected(tmp_path, caplog):
    a, b = gd.Variable(np.ones(2)), gd.Variable(np.zeros(3))
    path = Checkpoint(a=a, b=b).save(tmp_path / "c.npz")
    ckpt = Checkpoint(a=gd.Variable(np.zeros(2)))
    with caplog.at_level(logging.WARNING, logger="graphdist"):
        ckpt.restore(path)                                     # the status is dropped here
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        ckpt.restore(path).expect_partial()
        status = ckpt.restore(path)
        with pytest.raises(gd.CheckpointError):
            status.assert_consumed()
        del status
        Checkpoint(a=a, b=b).restore(path)                     # complete: nothing to say
    assert len(warned) == 1 and "'b'" in warned[0] and str(path) in warned[0]
    assert "expect_partial" in warned[0]
    assert caplog.records == []


# ---------------------------------------------------------------- item 3: replicas


REPLICAS3 = ["cpu:0", "cpu:1", "cpu:2"]


def _stats_model(strategy, width):
    """A BatchNorm (moving statistics: MEAN sync-on-read) and a SUM sync-on-read counter."""
    with strategy.scope():
        bn = gd.nn.BatchNorm()
        bn(np.ones((2, width), np.float32))                   # builds its variables
        total = gd.Variable(np.zeros(width, np.float32), name="total",
                            synchronization=gd.VariableSynchronization.ON_READ,
                            aggregation=gd.VariableAggregation.SUM)
    return {"bn": bn, "total": total}


def _as_if_assigned(var, value):
    """The components `var` holds after an ordinary cross-replica assign of `value`."""
    twin = gd.Variable(np.zeros(var.shape, var.dtype), synchronization=var.synchronization,
                       aggregation=var.aggregation, _devices=var.devices,
                       _strategy=var._strategy)
    twin.assign(value)
    return [np.array(c) for c in twin.values]


def test_sync_on_read_values_restore_exactly_across_replica_counts(tmp_path):
    rng = np.random.default_rng(3)
    width = 64
    saved = {"bn/moving_mean": np.r_[np.float32(0.1), np.float32(1 / 3),
                                     rng.standard_normal(width - 2).astype(np.float32)],
             "bn/moving_variance": rng.uniform(0.01, 10, width).astype(np.float32),
             "total": np.r_[np.float32(0.1), np.float32(1 / 3),
                            (rng.standard_normal(width - 2) * 1e3).astype(np.float32)]}
    one = _stats_model(gd.MirroredStrategy(["cpu:0"]), width)
    one["bn"].moving_mean.assign(saved["bn/moving_mean"])
    one["bn"].moving_variance.assign(saved["bn/moving_variance"])
    one["total"].assign(saved["total"])
    path = Checkpoint(**one).save(tmp_path / "one.npz")

    three = _stats_model(gd.MirroredStrategy(REPLICAS3), width)
    Checkpoint(**three).restore(path).assert_consumed()
    live = {"bn/moving_mean": three["bn"].moving_mean,
            "bn/moving_variance": three["bn"].moving_variance, "total": three["total"]}
    for key, var in live.items():
        assert len(var.values) == 3
        for got, want in zip(var.values, _as_if_assigned(var, saved[key]), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=key)   # the variable's own split
        np.testing.assert_array_equal(var.numpy(), saved[key], err_msg=key)

    back = Checkpoint(**three).save(tmp_path / "three.npz")
    again = _stats_model(gd.MirroredStrategy(["cpu:0"]), width)
    Checkpoint(**again).restore(back).assert_consumed()
    np.testing.assert_array_equal(again["bn"].moving_mean.numpy(), saved["bn/moving_mean"])
    np.testing.assert_array_equal(again["bn"].moving_variance.numpy(),
                                  saved["bn/moving_variance"])
    np.testing.assert_array_equal(again["total"].numpy(), saved["total"])


# ---------------------------------------------------------------- item 4: hostile files


def _small(tmp_path):
    """A valid checkpoint of w (float32[3]) and a momentum SGD after one step, and a
    Checkpoint of fresh objects whose every value differs from the file's."""
    w, sgd = _trained(gd.optimizers.SGD(0.1, momentum=0.9), steps=1)
    path = Checkpoint(w=w, opt=sgd).save(tmp_path / "good.npz")
    w2, sgd2 = _trained(gd.optimizers.SGD(0.3, momentum=0.5), steps=2, seed=7)
    return path, Checkpoint(w=w2, opt=sgd2)


def _edit_meta(fn):
    def edit(members):
        meta = _meta(members)
        result = fn(meta)
        members[META] = _meta_npy(meta if result is None else result)
        return members
    return edit


def _set_entry(key, **fields):
    def fn(meta):
        meta["entries"][key].update(fields)
    return _edit_meta(fn)


def _drop_field(key, field):
    def fn(meta):
        del meta["entries"][key][field]
    return _edit_meta(fn)


def _raw_meta(raw: bytes):
    def edit(members):
        members[META] = _meta_npy(raw)
        return members
    return edit


def _replace_member(name, data):
    def edit(members):
        members[name] = data
        return members
    return edit


def _nested(depth):
    return ('{"format": "graphdist.checkpoint", "version": 1, "entries": '
            + "[" * depth + "]" * depth + "}").encode()


MALFORMED = {
    "meta not json": (_raw_meta(b"{not json"), "metadata"),
    "meta not utf-8": (_raw_meta(b"\xff\xfe\x00"), "metadata"),
    "meta a list": (_raw_meta(b"[1, 2]"), "metadata"),
    "meta a string": (_raw_meta(b'"graphdist.checkpoint"'), "metadata"),
    "meta null": (_raw_meta(b"null"), "metadata"),
    "meta nested 100000 deep": (_raw_meta(_nested(100_000)), "metadata"),
    "format missing": (_edit_meta(lambda m: m.pop("format") and None), "format"),
    "format another": (_edit_meta(lambda m: m.update(format="tensorflow")), "format"),
    "version missing": (_edit_meta(lambda m: m.pop("version") and None), "version"),
    "version a string": (_edit_meta(lambda m: m.update(version="1")), "version"),
    "version true": (_edit_meta(lambda m: m.update(version=True)), "version"),
    "version 1.5": (_edit_meta(lambda m: m.update(version=1.5)), "version"),
    "version 0": (_edit_meta(lambda m: m.update(version=0)), "version"),
    "entries missing": (_edit_meta(lambda m: m.pop("entries") and None), "entries"),
    "entries a list": (_edit_meta(lambda m: m.update(entries=[])), "entries"),
    "entry a number": (_edit_meta(lambda m: m["entries"].update(w=5)), "'w'"),
    "shape missing": (_drop_field("w", "shape"), "'w'"),
    "dtype missing": (_drop_field("w", "dtype"), "'w'"),
    "shape a string": (_set_entry("w", shape="3"), "'w'"),
    "shape negative": (_set_entry("w", shape=[-3]), "'w'"),
    "shape huge": (_set_entry("w", shape=[2**62, 2**62]), "'w'"),
    "shape of floats": (_set_entry("w", shape=[3.0]), "'w'"),
    "shape nested": (_set_entry("w", shape=[[3]]), "'w'"),
    "dtype unknown": (_set_entry("w", dtype="float33"), "float33"),
    "dtype object": (_set_entry("w", dtype="object"), "object"),
    "dtype a number": (_set_entry("w", dtype=5), "'w'"),
    "bits wrong": (_set_entry("w", bits="uint8"), "uint8"),
    "optimizers a list": (_edit_meta(lambda m: m.update(optimizers=[])), "optimizers"),
    "optimizer type a number": (_edit_meta(lambda m: m["optimizers"]["opt"].update(type=3)),
                                "'opt'"),
    "optimizer slots a string": (
        _edit_meta(lambda m: m["optimizers"]["opt"].update(slots="momentum")), "'opt'"),
    # the entries themselves
    "object array": (_replace_member("w.npy", _npy_raw("|O", (3,), b"\x80\x04N." * 3)),
                     "object"),
    "truncated npy": (_replace_member("w.npy", _npy(np.ones(3, np.float32))[:-5]), "'w'"),
    "npy longer than its shape": (
        _replace_member("w.npy", _npy(np.ones(3, np.float32)) + b"\0" * 8), "'w'"),
    "npy header shape differs": (
        _replace_member("w.npy", _npy_raw("<f4", (2**40,), b"\0" * 12)), "'w'"),
    "npy bad magic": (_replace_member("w.npy", b"NOTNPY" + b"\0" * 100), "'w'"),
    "npy version 9": (_replace_member("w.npy", _npy_raw("<f4", (3,), b"\0" * 12,
                                                        version=b"\x09\x00")), "'w'"),
    "npy header garbage": (_replace_member("w.npy", b"\x93NUMPY\x01\x00\x10\x00"
                                           + b"__import__('os')\n" + b"\0" * 12), "'w'"),
    "member nothing lists": (_replace_member("stowaway.npy", _npy(np.ones(2))), "stowaway"),
    "entry without member": (lambda ms: ms.pop("w.npy") and ms, "'w'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata_and_entries_raise_checkpoint_error_and_change_nothing(
        tmp_path, case):
    edit, word = MALFORMED[case]
    path, ckpt = _small(tmp_path)
    bad = _write_zip(tmp_path / "bad.npz", edit(_members(path)).items())
    before = _state(ckpt)
    with pytest.raises(gd.CheckpointError) as err:
        ckpt.restore(bad)
    assert bad in str(err.value) and word in str(err.value)
    _assert_unchanged(ckpt, before)


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED],
                         ids=["stored", "deflated"])
def test_randomly_damaged_files_raise_checkpoint_error_or_restore(tmp_path, compression):
    """1000 seeded mutations (bytes overwritten, truncated, inserted) of a valid file: each
    restores the file's own values (damage where the zip reader does not look) or raises
    CheckpointError with nothing changed; no other exception."""
    path, ckpt = _small(tmp_path)
    base = _write_zip(tmp_path / "base.npz", _members(path).items(), compression)
    data = Path(base).read_bytes()
    different = ckpt.save(tmp_path / "different.npz")
    ckpt.restore(base)
    good = _state(ckpt)
    ckpt.restore(different)
    rng = np.random.default_rng(21)
    bad, outcomes = tmp_path / "damaged.npz", {"restored": 0, "refused": 0}
    for _ in range(1000):
        damaged, at = bytearray(data), int(rng.integers(len(data)))
        kind = rng.integers(3)
        if kind == 0:
            for spot in rng.integers(len(data), size=rng.integers(1, 8)):
                damaged[spot] = rng.integers(256)
        elif kind == 1:
            damaged = damaged[:at]
        else:
            damaged[at:at] = rng.integers(0, 256, rng.integers(1, 40)).astype(np.uint8).tobytes()
        bad.write_bytes(bytes(damaged))
        before = _state(ckpt)
        try:
            ckpt.restore(bad).expect_partial()
            outcomes["restored"] += 1
            _assert_unchanged(ckpt, good)                  # exactly the file's values
            ckpt.restore(different)
        except gd.CheckpointError:
            _assert_unchanged(ckpt, before)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 900


def test_metadata_larger_than_the_bound_is_not_read(tmp_path, monkeypatch):
    from graphdist import checkpoint_format

    path, ckpt = _small(tmp_path)
    monkeypatch.setattr(checkpoint_format, "MAX_META_BYTES", 1000)
    members = _members(path)
    meta = _meta(members)
    meta["padding"] = "x" * 2000
    members[META] = _meta_npy(meta)
    with pytest.raises(gd.CheckpointError, match="1000"):
        ckpt.restore(_write_zip(tmp_path / "big_meta.npz", members.items()))


@pytest.mark.parametrize("second", ["w.npy", "w"])
def test_duplicate_member_names_are_refused(tmp_path, second):
    path, ckpt = _small(tmp_path)
    members = _members(path)
    items = list(members.items()) + [(second, _npy(np.full(3, 9, np.float32)))]
    before = _state(ckpt)
    with pytest.raises(gd.CheckpointError, match=f"'{second}' appears twice"):
        ckpt.restore(_write_zip(tmp_path / "dup.npz", items))
    _assert_unchanged(ckpt, before)


def test_a_big_endian_entry_says_what_differs(tmp_path):
    path, ckpt = _small(tmp_path)
    members = _members(path)
    members["w.npy"] = _npy(np.arange(3, dtype=">f4"))
    with pytest.raises(gd.CheckpointError) as err:
        ckpt.restore(_write_zip(tmp_path / "be.npz", members.items()))
    assert "entry 'w' is stored big-endian (>f4)" in str(err.value)
    assert "little-endian (<f4)" in str(err.value)


def test_only_stored_and_deflated_entries_are_read(tmp_path):
    path, ckpt = _small(tmp_path)
    w_before = ckpt.w.numpy()
    compressed = _write_zip(tmp_path / "deflated.npz", _members(path).items(),
                            zipfile.ZIP_DEFLATED)           # as np.savez_compressed writes
    ckpt.restore(compressed).assert_consumed()
    assert not np.array_equal(ckpt.w.numpy(), w_before)
    ckpt.w.assign(w_before)
    before = _state(ckpt)
    bz = _write_zip(tmp_path / "bz.npz", _members(path).items(), zipfile.ZIP_BZIP2)
    with pytest.raises(gd.CheckpointError, match="compress"):  # unbounded decompressors
        ckpt.restore(bz)
    _assert_unchanged(ckpt, before)


def test_a_fortran_ordered_entry_restores(tmp_path):
    w = gd.Variable(np.zeros((2, 3), np.float32), name="w")
    path = Checkpoint(w=w).save(tmp_path / "c.npz")
    members = _members(path)
    value = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    members["w.npy"] = _npy(value)
    Checkpoint(w=w).restore(_write_zip(tmp_path / "f.npz", members.items()))
    np.testing.assert_array_equal(w.numpy(), value)


@pytest.mark.parametrize("kind", ["fifo", "directory", "/dev/zero"])
def test_a_file_that_is_not_regular_is_refused_without_hanging(tmp_path, kind):
    w = gd.Variable(np.ones(3, np.float32))
    target = {"fifo": str(tmp_path / "ckpt.npz"), "directory": str(tmp_path),
              "/dev/zero": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(target)
    outcome = []

    def restore():
        try:
            Checkpoint(w=w).restore(target)
        except Exception as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    worker = threading.Thread(target=restore, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive() and kind == "fifo":                 # unblock a reader stuck on open
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
        pytest.fail("restore blocked on a FIFO")
    [error] = outcome
    assert isinstance(error, gd.CheckpointError) and "not a regular file" in str(error)
    assert target in str(error)


def test_saving_into_a_missing_folder_names_it(tmp_path):
    ckpt = Checkpoint(w=gd.Variable(np.ones(2)))
    folder = tmp_path / "no" / "such"
    with pytest.raises(gd.CheckpointError) as err:
        ckpt.save(folder / "c.npz")
    assert f"{folder}" in str(err.value) and "does not exist" in str(err.value)
    with pytest.raises(gd.CheckpointError, match="is a folder"):
        ckpt.save(tmp_path)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- memory bounds

BOUNDED = r"""
import json, resource, sys
import numpy as np
import graphdist as gd

def vm_bytes():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

w = gd.Variable(np.zeros(3, np.float32), name="w")
ckpt = gd.Checkpoint(w=w)
ckpt.restore(sys.argv[1]).assert_consumed()          # everything restore needs is loaded
limit = vm_bytes() + (200 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
results = {}
for name, path in json.loads(sys.argv[2]).items():
    w.assign(np.zeros(3, np.float32))
    try:
        ckpt.restore(path).expect_partial()
        results[name] = ["restored", w.numpy().tolist()]
    except Exception as e:
        results[name] = [type(e).__name__, str(e)[:400]]
print(json.dumps(results))
"""

GIB = 1 << 30


def _zip_with_zeros(path, members, name, header, zeros):
    """A zip of `members` plus `name`: `header` then `zeros` zero bytes, deflated while it is
    written (about 1 MB per GB), so the test itself stays small."""
    chunk = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        info = zipfile.ZipInfo(name)
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as out:
            out.write(header)
            for start in range(0, zeros, len(chunk)):
                out.write(chunk[:min(len(chunk), zeros - start)])
    return str(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_hostile_sizes_are_refused_before_memory_is_spent(tmp_path):
    """Under an address-space limit of 200 MB above what the process already maps: a 1 GiB
    untracked entry (a zip bomb) is never decompressed, a tracked entry whose .npy header
    declares 8 GiB is refused before allocating, and one whose zip member holds 512 MiB
    after its 12 bytes is refused before reading them."""
    good = Checkpoint(w=gd.Variable(np.arange(3, dtype=np.float32), name="w")).save(
        tmp_path / "good.npz")
    members = _members(good)
    meta = _meta(members)
    n = GIB // 4                                             # 1 GiB of float32 zeros
    meta["entries"]["bomb"] = {"shape": [n], "dtype": "float32"}
    with_bomb = dict(members, **{META: _meta_npy(meta)})
    bomb = _zip_with_zeros(tmp_path / "bomb.npz", with_bomb, "bomb.npy",
                           _npy_raw("<f4", (n,)), 4 * n)
    assert os.path.getsize(bomb) < 4 << 20                   # a few MB on disk
    huge_header = dict(members, **{"w.npy": _npy_raw("<f4", (2**31,), bytes(12))})
    huge = _write_zip(tmp_path / "huge.npz", huge_header.items())
    trailing = dict(members)
    del trailing["w.npy"]
    padded = _zip_with_zeros(tmp_path / "trailing.npz", trailing, "w.npy",
                             _npy(np.arange(3, dtype=np.float32)), GIB // 2)
    cases = {"bomb": bomb, "huge": huge, "trailing": padded}
    done = subprocess.run([sys.executable, "-c", BOUNDED, good, json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results["bomb"] == ["restored", [0.0, 1.0, 2.0]]  # the untracked entry never read
    assert results["huge"][0] == "CheckpointError" and "(2147483648,)" in results["huge"][1]
    assert results["trailing"][0] == "CheckpointError" and "'w'" in results["trailing"][1]
