"""gd.Checkpoint: save and restore Variables, optimizers and objects holding them.

One `.npz` file per checkpoint (numpy arrays, no pickle) with a JSON `__meta__` entry
(checkpoint_format.py reads and writes the file, treating it as untrusted input).
Entries are keyed by object path (`model/dense1/w`, `opt/iterations`, `opt/hyper/learning_rate`,
and slots by the path of their variable: `opt/slots/model/dense1/w/m`); the metadata records
each optimizer's type and slot names, so another optimizer's state is refused. Restore checks
everything against the metadata before it reads an entry, reads only the entries it tracks,
writes nothing until all of them are read, and returns a RestoreStatus saying what the file
did not cover.
bfloat16 (an ml_dtypes type the .npy format cannot name) is stored as its uint16 bits, the
entry's metadata naming both ("dtype": "bfloat16", "bits": "uint16").
An object with a `_checkpoint_children()` method (gd.nn layers) lists its own (key, child) pairs.
"""

from __future__ import annotations

import json
import os
import re
import types

import numpy as np

from graphdist.checkpoint_format import (BITS, FORMAT, HOST, META, STALE_TEMP_S, VERSION,
                                         CheckpointFile, describe, remove_stale_temps,
                                         write_atomically)
from graphdist.config import logger
from graphdist.errors import CheckpointError, TraceError, WorkerError
from graphdist.ops.core import current_tracer
from graphdist.variables import Variable

_HOST = HOST                       # the host name in temp file names (see checkpoint_format)
_LEAVES = (str, bytes, int, float, complex, bool, type(None), np.ndarray, np.generic, type,
           types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _is_optimizer(obj) -> bool:
    # duck typing: anything with an `iterations` Variable, a `_slots` dict and `slot(var, name)`
    return (isinstance(getattr(obj, "iterations", None), Variable)
            and isinstance(getattr(obj, "_slots", None), dict) and callable(obj.slot))


def _escape(key) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def _unescape(key: str) -> str:
    return re.sub("%2F|%25", lambda m: "/" if m.group() == "%2F" else "%", key)


def _children(obj):
    if isinstance(obj, Checkpoint):
        return obj._trackables.items()
    if isinstance(obj, dict):
        return obj.items()
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    if not isinstance(obj, type) and callable(getattr(obj, "_checkpoint_children", None)):
        return obj._checkpoint_children()   # objects that say what they own (gd.nn layers)
    if isinstance(obj, _LEAVES) or type(obj).__module__.startswith("graphdist."):
        return ()       # gd.function objects, strategies...: they hold variables they don't own
    return getattr(obj, "__dict__", {}).items()


def _walk(obj, path: str, seen: set, variables: dict, optimizers: dict) -> None:
    """Fill `variables` and `optimizers` ({path: object}); an object reached twice keeps its
    first path."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Variable):
        variables[path] = obj
    elif not isinstance(obj, Checkpoint) and _is_optimizer(obj):
        optimizers[path] = obj
    else:
        for key, child in list(_children(obj)):
            _walk(child, f"{path}/{_escape(key)}" if path else _escape(key), seen, variables,
                  optimizers)


class Checkpoint:
    """Saves and restores the variables reachable from its keyword arguments.

    >>> w = gd.Variable(np.zeros(3, np.float32), name="w")
    >>> ckpt = gd.Checkpoint(model={"w": w}, opt=gd.optimizers.Adam())
    >>> path = ckpt.save("/tmp/ckpt.npz"); ckpt.restore(path)
    """

    def __init__(self, **trackables):
        for name, obj in trackables.items():
            if name == META:
                raise ValueError(f"Checkpoint: the name {META!r} is reserved")
            if isinstance(obj, _LEAVES):
                raise TypeError(f"Checkpoint: {name!r} is a {type(obj).__name__}, which holds "
                                "no variables; track gd.Variables, optimizers or objects "
                                "holding them")
        self._trackables = dict(trackables)

    def __getattr__(self, name):
        try:
            return self.__dict__["_trackables"][name]
        except KeyError:
            raise AttributeError(f"Checkpoint has no trackable {name!r}") from None

    # ------------------------------------------------------------ what is tracked
    def _entries(self) -> tuple[dict, dict, dict, dict]:
        """({path: Variable} of every entry saved, {path: Variable} of the plain ones,
        {path: optimizer}, {slot path: (optimizer, variable, slot name)})."""
        plain, optimizers = {}, {}
        _walk(self, "", set(), plain, optimizers)
        path_of = {id(v): p for p, v in plain.items()}
        variables, slots = dict(plain), {}
        for p, opt in optimizers.items():
            variables[f"{p}/iterations"] = opt.iterations
            for name, var in getattr(opt, "_hyper", {}).items():   # learning_rate, beta_1...
                variables[f"{p}/hyper/{_escape(name)}"] = var
            for (var, name), slot in opt._slots.items():
                if id(var) in path_of:   # as in TF: slots of untracked variables are not saved
                    key = f"{p}/slots/{path_of[id(var)]}/{_escape(name)}"
                    variables[key] = slot
                    slots[key] = (opt, var, name)
            variables.update(_accumulation_entries(p, opt, path_of))
        return variables, plain, optimizers, slots

    # ------------------------------------------------------------ finding one
    @staticmethod
    def latest(directory) -> str | None:
        """The newest whole checkpoint file in `directory`, or None: a job restarted after
        a failure resumes from it. Whole: a complete checkpoint (saves are atomic, so
        half-written temp files are skipped, and so is any file that is not one). Newest:
        by the step number in the name when every candidate has one ('ckpt-12.npz'),
        else by modification time."""
        import zipfile

        found = []
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name.startswith(".") or name.endswith(".tmp") or not os.path.isfile(path):
                continue
            try:
                with zipfile.ZipFile(path) as zf:
                    if f"{META}.npy" not in zf.namelist():
                        continue
            except (OSError, zipfile.BadZipFile):
                continue
            numbers = re.findall(r"\d+", name)
            found.append((int(numbers[-1]) if numbers else None, os.path.getmtime(path), path))
        if not found:
            return None
        if all(step is not None for step, _, _ in found):
            return max(found)[2]
        return max(found, key=lambda item: (item[1], item[2]))[2]

    # ------------------------------------------------------------ save
    def save(self, path):
        """Write every tracked variable to `path` atomically and return `path`."""
        if current_tracer() is not None:
            raise TraceError("Checkpoint.save inside traced code would save trace-time values; "
                             "call it between steps")
        variables, _, optimizers, _ = self._entries()
        group = _workers(variables.values())
        if group is not None:
            # every worker must be here, saving the same variables, before any value moves
            # (sync-on-read reads below sum across them): one elsewhere, in a step or
            # another collective, makes every worker raise WorkerError naming both
            from graphdist.runtime.schedule_check import agree_on_collective

            agree_on_collective(group, "Checkpoint.save", (len(variables),), "variables")
        entries, arrays = {}, {}
        for key, var in variables.items():
            arrays[key] = value = var.numpy()      # mirrored: one copy; sync-on-read: aggregate
            entries[key] = {"shape": list(value.shape), "dtype": value.dtype.name,
                            "synchronization": var.synchronization.value,
                            "aggregation": var.aggregation.value,
                            "components": len(var.values)}
            if value.dtype.name in BITS:
                arrays[key] = value.view(BITS[value.dtype.name])
                entries[key]["bits"] = BITS[value.dtype.name]
        optimizers = {p: {"type": type(opt).__name__,      # restore refuses another type's
                          "slots": sorted({name for _, name in opt._slots})}
                      for p, opt in optimizers.items()}
        meta = json.dumps({"format": FORMAT, "version": VERSION, "entries": entries,
                           "optimizers": optimizers})
        arrays[META] = np.frombuffer(meta.encode(), np.uint8)
        if group is None:
            write_atomically(os.fspath(path), arrays)
            return path
        # every worker calls save (sync-on-read values are aggregated across them above);
        # the chief writes, and every worker learns whether it did before returning
        failed = None
        if group.rank == 0:
            try:
                write_atomically(os.fspath(path), arrays)
            except Exception as e:  # noqa: BLE001 - reported to every worker below
                failed = f"{type(e).__name__}: {e}"
        failed = group.bcast_object(failed, 0, f"the checkpoint {os.fspath(path)!r} the chief "
                                    "writes")
        if failed is not None:
            raise CheckpointError(f"the chief (worker 0) could not write "
                                  f"{os.fspath(path)!r}: {failed}")
        return path

    # ------------------------------------------------------------ restore
    def restore(self, path) -> RestoreStatus:
        """Load `path` into the tracked variables, creating optimizer slots that do not exist
        yet, and return a RestoreStatus (`assert_consumed()`, `expect_partial()`). Raises
        CheckpointError, changing nothing, if the file does not fit. Only the entries
        something tracks are decompressed. Under a multi-worker strategy every worker calls
        it, and the workers compare checksums of what they read before writing: values that
        differ from the chief's raise gd.WorkerError on every worker, naming the files."""
        if current_tracer() is not None:
            raise TraceError("Checkpoint.restore inside traced code; call it between steps")
        path = os.fspath(path)
        self._make_accumulators(path)
        entries = self._entries()
        group = _workers(entries[0].values())
        try:
            with CheckpointFile(path) as file:
                plan = _RestorePlan(file, *entries)
                values = {key: plan.value(key) for _, key in plan.writes if key is not None}
        except Exception as e:
            if group is not None:                 # the others must not wait, nor go on alone
                _agree_on_restore(group, path, None, e)
            raise
        if group is not None:
            _agree_on_restore(group, path, values, None)
        for target, key in plan.writes:            # every check passed: now write
            if isinstance(target, tuple):
                opt, var, name = target            # a slot the optimizer has not made yet
                target = opt.slot(var, name)
            value = values[key] if key is not None else np.zeros(target.shape, target.dtype)
            # the variable's own cross-replica write: a SUM sync-on-read value is split as
            # an assign splits it, so the value reads back exactly on any replica count
            target.assign_components(target.components_for(value))
        used = {key for _, key in plan.writes}
        return RestoreStatus(path, sorted(set(file.entries) - used), plan.unrestored)

    def _make_accumulators(self, path: str) -> None:
        """An accumulating optimizer makes its accumulators on its first step; a file saved
        mid-window restores into them, so make the ones the file has first (zeros: what
        they start as). A file that cannot be read is reported by restore itself."""
        plain, optimizers = {}, {}
        _walk(self, "", set(), plain, optimizers)
        wanted = [(p, opt) for p, opt in optimizers.items()
                  if getattr(opt, "accumulation_checkpoint", dict)()]
        if not wanted:
            return
        try:
            with CheckpointFile(path) as file:
                keys = set(file.entries)
        except Exception:  # noqa: BLE001 - restore raises it below, with its context
            return
        for p, opt in wanted:
            for var_path, var in plain.items():
                if f"{p}/accumulation/{var_path}" in keys:
                    opt._accumulator(var)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._trackables)})"


def _accumulation_entries(p: str, opt, path_of: dict) -> dict:
    """A gradient-accumulating optimizer's window: its micro-step counter and each tracked
    variable's accumulator (read whole), so a restore resumes mid-window."""
    state = getattr(opt, "accumulation_checkpoint", dict)()
    out = {f"{p}/accumulation/step": state["step"]} if "step" in state else {}
    for var, acc in state.items():
        if not isinstance(var, str) and id(var) in path_of:
            out[f"{p}/accumulation/{path_of[id(var)]}"] = acc
    return out


def _names(keys, limit: int = 8) -> str:
    keys = list(keys)
    shown = ", ".join(f"'{k}'" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class _RestorePlan:
    """Everything a restore will write, checked against the file's metadata before any entry
    is read: `writes` is [(Variable or (optimizer, variable, slot name), entry key or None
    for zeros)], `unrestored` {tracked key: why the file did not restore it}."""

    def __init__(self, file, variables, plain, optimizers, slots):
        self.file, self.path = file, file.path
        self.variables, self.plain, self.slots = variables, plain, slots
        self.path_of = {id(v): p for p, v in plain.items()}
        self.writes, self.unrestored, self._values = [], {}, {}
        for p, opt in optimizers.items():
            self._check_type(p, opt)
        hyper = {f"{p}/hyper/{_escape(name)}" for p, opt in optimizers.items()
                 for name in getattr(opt, "_hyper", {})}
        accumulation = tuple(f"{p}/accumulation/" for p in optimizers)
        for key, var in variables.items():
            if key in slots:
                continue                               # per optimizer, below
            if key in file.entries:
                self._check(key, var, f"variable {var.name!r}")
                self.writes.append((var, key))
            elif key in hyper:                         # saved before hyper-parameters were
                self.unrestored[key] = "kept its value: the file predates saved hyper-parameters"
            elif key.startswith(accumulation):         # saved without accumulation
                self.writes.append((var, None))
                self.unrestored[key] = ("reset to zeros: the file has no gradient accumulation "
                                        "window (the window starts empty)")
            else:
                raise CheckpointError(f"{self.path}: tracked variable '{key}' ({var.name!r}, "
                                      f"{describe(var.shape, var.dtype)}) is absent from the "
                                      "file")
        for p, opt in optimizers.items():
            self._plan_slots(p, opt)

    def value(self, key):
        if key not in self._values:
            self._values[key] = self.file.read(key)
        return self._values[key]

    def _check(self, key, var, what) -> None:
        entry = self.file.entries[key]
        if entry.shape != tuple(var.shape) or entry.dtype != var.dtype:
            raise CheckpointError(f"{self.path}: entry '{key}': {what} has "
                                  f"{describe(var.shape, var.dtype)}, the file has "
                                  f"{describe(entry.shape, entry.dtype)}")

    # ---------------------------------------------------------------- optimizers
    def _check_type(self, p, opt) -> None:
        """Another optimizer's state is refused: by the recorded type, or, in a file from
        before types were recorded, by its hyper-parameter and slot names."""
        theirs = sorted(k for k in self.file.entries if k.startswith(f"{p}/"))
        mine = type(opt).__name__
        recorded = self.file.optimizers.get(p)
        if recorded is not None:
            if recorded["type"] != mine:
                raise CheckpointError(
                    f"{self.path}: the entries {_names(theirs)} hold the state of an optimizer "
                    f"of type {recorded['type']}; '{p}' here is of type {mine}. Restore into "
                    f"the same type, or track only the model to leave '{p}' as it is")
            self._check_slot_names(p, opt, set(recorded["slots"]), theirs)
            return
        hyper = {_unescape(k[len(f"{p}/hyper/"):]) for k in theirs
                 if k.startswith(f"{p}/hyper/")}
        live_hyper = set(getattr(opt, "_hyper", {}))
        slot_names, live_slots = self._file_slot_names(p), {n for _, n in opt._slots}
        if (hyper and hyper != live_hyper) or (slot_names and live_slots
                                               and slot_names != live_slots):
            raise CheckpointError(
                f"{self.path}: the entries {_names(theirs)} hold another optimizer's state "
                f"(hyper-parameters {sorted(hyper)}, slots {sorted(slot_names)}); '{p}' here "
                f"is of type {mine} (hyper-parameters {sorted(live_hyper)}, slots "
                f"{sorted(live_slots)})")

    def _check_slot_names(self, p, opt, kept: set, theirs: list) -> None:
        """The same type keeping other slots is another optimizer's state too: SGD with
        momentum into SGD without (its momentum buffers would be restored and never used),
        or the other way once the file's optimizer has taken steps (its momentum would
        silently restart from zeros)."""
        live = getattr(opt, "slot_names", None)
        if live is None or kept == set(live) or not (kept or self._steps(p) > 0):
            return
        mine = type(opt).__name__
        raise CheckpointError(
            f"{self.path}: the entries {_names(theirs)} hold the state of a {mine} that keeps "
            f"the slots {sorted(kept) or 'none'} per variable; '{p}' here keeps "
            f"{sorted(live) or 'none'} (made with other settings, such as momentum). Restore "
            f"into a {mine} made as the saved one was")

    def _steps(self, p) -> int:
        key = f"{p}/iterations"
        return int(self.value(key)) if key in self.file.entries else 0

    def _file_slots(self, p) -> dict:
        """{tracked variable path: {slot name: entry key}} of the file's slots of `p`."""
        prefix, found = f"{p}/slots/", {}
        for key in self.file.entries:
            if key.startswith(prefix):
                var_path, _, name = key[len(prefix):].rpartition("/")
                if var_path in self.plain:     # else: nothing tracks that variable here
                    found.setdefault(var_path, {})[_unescape(name)] = key
        return found

    def _file_slot_names(self, p) -> set:
        recorded = self.file.optimizers.get(p)
        if recorded is not None:
            return set(recorded["slots"])
        return {name for names in self._file_slots(p).values() for name in names}

    def _plan_slots(self, p, opt) -> None:
        """Each slot of a tracked variable: from the file; a missing one is an error when the
        file's optimizer has taken steps (zeros would silently restart its averages), else
        zeros, its initial value."""
        have, live = self._file_slots(p), {}
        for key, (owner, var, name) in self.slots.items():
            if owner is opt:
                live.setdefault(self.path_of[id(var)], {})[name] = key
        names, missing = self._file_slot_names(p), []
        for var_path in sorted(set(have) | set(live)):
            var, in_file = self.plain[var_path], have.get(var_path, {})
            for name, key in sorted(in_file.items()):
                self._check(key, var, f"the {name!r} slot of variable {var.name!r}")
                self.writes.append((self.variables.get(key, (opt, var, name)), key))
            for name in sorted((set(live.get(var_path, {})) | (names if in_file else set()))
                               - set(in_file)):
                key = f"{p}/slots/{var_path}/{_escape(name)}"
                missing.append(key)
                if key in self.slots:                  # before the first step: zeros
                    self.writes.append((self.variables[key], None))
                    self.unrestored[key] = "reset to zeros: the file has no such slot"
        steps = int(self.value(f"{p}/iterations")) if missing else 0
        if steps > 0:
            raise CheckpointError(
                f"{self.path}: the {type(opt).__name__} optimizer '{p}' had taken {steps} "
                f"steps, but the file lacks its slots {_names(missing)}; restoring would reset "
                "them to zeros. The file is incomplete or from another optimizer")


class RestoreStatus:
    """What Checkpoint.restore did, as TensorFlow's load status: `assert_consumed()` raises
    unless every entry of the file was used and every tracked value restored,
    `assert_existing_objects_matched()` only the latter. A partial restore whose status is
    dropped unchecked logs a warning, unless `expect_partial()` said it is intended.

    Slots the optimizer has not made yet are made by restore itself, so no value is ever
    left pending for later: a restore is complete or not when it returns."""

    def __init__(self, path: str, unused: list, unrestored: dict):
        self.path, self.unused, self.unrestored = path, unused, dict(unrestored)
        self._silent = not (unused or unrestored)

    def assert_consumed(self) -> RestoreStatus:
        self._silent = True
        if self.unused or self.unrestored:
            raise CheckpointError(f"{self.path}: the restore was partial: {self._what()}")
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        self._silent = True
        if self.unrestored:
            raise CheckpointError(f"{self.path}: the file did not restore every tracked value: "
                                  f"{self._unrestored_text()}")
        return self

    def expect_partial(self) -> RestoreStatus:
        """Say a partial restore is intended (no warning when the status is dropped)."""
        self._silent = True
        return self

    def _unrestored_text(self) -> str:
        return "; ".join(f"'{k}' {why}" for k, why in sorted(self.unrestored.items()))

    def _what(self) -> str:
        parts = []
        if self.unused:
            parts.append(f"entries nothing tracks: {_names(self.unused)}")
        if self.unrestored:
            parts.append(f"tracked values the file did not restore: {self._unrestored_text()}")
        return "; ".join(parts)

    def __del__(self):
        if not self._silent:
            try:
                logger.warning("%s: the restore was partial (%s); call .expect_partial() on "
                               "the status restore returns if that is intended, or "
                               ".assert_consumed() to make it an error", self.path,
                               self._what())
            except Exception:  # noqa: BLE001 - the interpreter may be shutting down
                pass

    def __repr__(self) -> str:
        return (f"<RestoreStatus {self.path!r}: {len(self.unused)} unused entries, "
                f"{len(self.unrestored)} tracked values not restored>")


def _agree_on_restore(group, path: str, values, error) -> None:
    """Before anything is written: every worker read the same values (the chief's file is
    authoritative), else every worker raises gd.WorkerError naming the files and ranks. A
    stale file on one node would otherwise train different "mirrored" weights."""
    from graphdist.distribute.multi_worker import digest, exchange

    checksum = None if values is None else digest(np.frombuffer("".join(
        f"{key}:{digest(values[key])};" for key in sorted(values)).encode(), np.uint8))
    every = exchange(group, {"path": path, "checksum": checksum,
                             "error": None if error is None else f"{type(error).__name__}: "
                                                                 f"{error}"},
                     f"the restore of {path!r}", "restore")
    for rank, theirs in enumerate(every):
        if theirs["error"] is not None:
            if error is not None:
                return                            # the caller raises its own error
            raise WorkerError(f"Checkpoint.restore: worker {rank} could not restore "
                              f"{theirs['path']!r}: {theirs['error']}; nothing was restored")
    chief = every[0]
    for rank, theirs in enumerate(every):
        if theirs["checksum"] != chief["checksum"]:
            raise WorkerError(
                f"Checkpoint.restore: worker {rank} read {theirs['path']!r}, whose values "
                f"differ from those the chief (worker 0) read from {chief['path']!r} "
                f"(checksums {theirs['checksum'][:12]} and {chief['checksum'][:12]}); every "
                "worker must restore the same checkpoint (a stale file on one node?); "
                "nothing was restored")


def _workers(variables):
    """The process group of a multi-worker strategy the variables belong to, else None."""
    for var in variables:
        group = getattr(var._strategy, "_group", None)
        if group is not None and group.size > 1:
            return group
    return None


__all__ = ["Checkpoint", "CheckpointError", "RestoreStatus", "STALE_TEMP_S",
           "remove_stale_temps"]
