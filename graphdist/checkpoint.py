"""gd.Checkpoint: save and restore Variables, optimizers and objects holding them.

One `.npz` file per checkpoint (numpy arrays, no pickle) with a JSON `__meta__` entry.
Entries are keyed by object path (`model/dense1/w`, `opt/iterations`, `opt/hyper/learning_rate`,
and slots by the path of their variable: `opt/slots/model/dense1/w/m`). Restore validates
everything first.
bfloat16 (an ml_dtypes type the .npy format cannot name) is stored as its uint16 bits, the
entry's metadata naming both ("dtype": "bfloat16", "bits": "uint16").
An object with a `_checkpoint_children()` method (gd.nn layers) lists its own (key, child) pairs.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import time
import types
import uuid
import zipfile

import numpy as np

from graphdist.errors import CheckpointError, TraceError
from graphdist.ir.types import as_dtype
from graphdist.ops.core import current_tracer
from graphdist.variables import Variable

FORMAT, VERSION, META = "graphdist.checkpoint", 1, "__meta__"
_BITS = {"bfloat16": "uint16"}     # dtypes stored as raw bits: the .npy header cannot name them
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


def _describe(shape, dtype) -> str:
    return f"shape {tuple(shape)} dtype {np.dtype(dtype).name}"


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
        return variables, plain, optimizers, slots

    # ------------------------------------------------------------ save
    def save(self, path):
        """Write every tracked variable to `path` atomically and return `path`."""
        if current_tracer() is not None:
            raise TraceError("Checkpoint.save inside traced code would save trace-time values; "
                             "call it between steps")
        variables = self._entries()[0]
        entries, arrays = {}, {}
        for key, var in variables.items():
            arrays[key] = value = var.numpy()      # mirrored: one copy; sync-on-read: aggregate
            entries[key] = {"shape": list(value.shape), "dtype": value.dtype.name,
                            "synchronization": var.synchronization.value,
                            "aggregation": var.aggregation.value,
                            "components": len(var.values)}
            if value.dtype.name in _BITS:
                arrays[key] = value.view(_BITS[value.dtype.name])
                entries[key]["bits"] = _BITS[value.dtype.name]
        meta = json.dumps({"format": FORMAT, "version": VERSION, "entries": entries})
        arrays[META] = np.frombuffer(meta.encode(), np.uint8)
        group = _workers(variables.values())
        if group is None:
            _write_atomically(os.fspath(path), arrays)
            return path
        # every worker calls save (sync-on-read values are aggregated across them above);
        # the chief writes, and every worker learns whether it did before returning
        failed = None
        if group.rank == 0:
            try:
                _write_atomically(os.fspath(path), arrays)
            except Exception as e:  # noqa: BLE001 - reported to every worker below
                failed = f"{type(e).__name__}: {e}"
        failed = group.bcast_object(failed, 0, f"the checkpoint {os.fspath(path)!r} the chief "
                                    "writes")
        if failed is not None:
            raise CheckpointError(f"the chief (worker 0) could not write "
                                  f"{os.fspath(path)!r}: {failed}")
        return path

    # ------------------------------------------------------------ restore
    def restore(self, path) -> None:
        """Load `path` into the tracked variables, creating optimizer slots that do not exist
        yet. Raises CheckpointError, changing nothing, if the file does not fit."""
        if current_tracer() is not None:
            raise TraceError("Checkpoint.restore inside traced code; call it between steps")
        path = os.fspath(path)
        arrays = _read(path)
        variables, plain, optimizers, slots = self._entries()
        plan = []                      # (variable or (optimizer, variable, slot name), arrays)

        def check(key, shape, dtype, what):
            got = arrays[key]
            if got.shape != tuple(shape) or got.dtype != dtype:
                raise CheckpointError(f"{path}: entry '{key}': {what} has "
                                      f"{_describe(shape, dtype)}, the file has "
                                      f"{_describe(got.shape, got.dtype)}")

        hyper = {f"{p}/hyper/{_escape(name)}" for p, opt in optimizers.items()
                 for name in getattr(opt, "_hyper", {})}
        for key, var in variables.items():
            if key not in arrays:
                if key in slots:           # saved before the slot existed: zeros
                    plan.append((var, [np.zeros(var.shape, var.dtype)] * len(var.values)))
                    continue
                if key in hyper:           # saved before hyper-parameters were state: keep
                    continue
                raise CheckpointError(f"{path}: tracked variable '{key}' ({var.name!r}, "
                                      f"{_describe(var.shape, var.dtype)}) is absent from the "
                                      "file")
            check(key, var.shape, var.dtype, f"variable {var.name!r}")
            plan.append((var, var.components_for(arrays[key])))
        for p, opt in optimizers.items():
            prefix = f"{p}/slots/"
            for key in arrays:
                if not key.startswith(prefix) or key in variables:
                    continue
                var_path, _, name = key[len(prefix):].rpartition("/")
                var = plain.get(var_path)
                if var is None:
                    continue                       # nothing tracks that variable here
                check(key, var.shape, var.dtype, f"the slot of variable {var.name!r}")
                plan.append(((opt, var, _unescape(name)), [arrays[key]] * len(var.devices)))
        for target, values in plan:                # every check passed: now write
            if not isinstance(target, Variable):
                opt, var, name = target            # a slot the optimizer has not made yet
                target = opt.slot(var, name)
            target.assign_components(values)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._trackables)})"


def _workers(variables):
    """The process group of a multi-worker strategy the variables belong to, else None."""
    for var in variables:
        group = getattr(var._strategy, "_group", None)
        if group is not None and group.size > 1:
            return group
    return None


# A save writes `.NAME.HOST.PID.RANDOM.tmp` beside NAME, then renames it over NAME. A save
# killed part-way leaves that temp file behind; the next save to NAME removes the stale ones:
# of a dead process on this host, or (any host, or the older `.NAME.RANDOM.tmp` form)
# untouched for STALE_TEMP_S, longer than any save goes without writing. A concurrent save's
# temp file (a live process, recently written) is left alone.
STALE_TEMP_S = 30 * 60
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"


def _temp_pattern(path: str):
    return re.compile(rf"\.{re.escape(os.path.basename(path))}\."
                      r"(?:(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.)?[0-9a-f]{8}\.tmp")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True                               # no cheap check: go by age alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                               # EPERM: alive, another user's
        return True
    return True


def remove_stale_temps(path: str) -> list[str]:
    """Remove the temp files that killed saves to `path` left behind; returns their paths."""
    directory = os.path.dirname(path) or "."
    pattern, removed = _temp_pattern(path), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        full = os.path.join(directory, name)
        try:
            old = now - os.stat(full).st_mtime > STALE_TEMP_S
        except OSError:                           # gone already (another saver cleaned it)
            continue
        dead = m["host"] == _HOST and not _pid_alive(int(m["pid"]))
        if old or dead:
            try:
                os.unlink(full)
                removed.append(full)
            except OSError:
                pass
    return removed


def _write_atomically(path: str, arrays: dict) -> None:
    remove_stale_temps(path)
    # temp file in the target's directory (os.replace must not cross filesystems), created
    # with mode 0o666 so the umask applies as for any new file
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{_HOST}."
                       f"{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for key, value in arrays.items():    # what np.savez writes, with free names
                    with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asarray(value),
                                                  allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:                                          # make the rename itself durable
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _read(path: str) -> dict:
    """Every entry of the file as {key: array}; CheckpointError for anything unreadable."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = {}
            for info in zf.infolist():         # zf.read checks each member's CRC
                name = info.filename.removesuffix(".npy")
                members[name] = np.lib.format.read_array(io.BytesIO(zf.read(info)),
                                                         allow_pickle=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({e})") from e
    if META not in members:
        raise CheckpointError(f"{path}: not a graphdist checkpoint (no {META} entry)")
    try:
        meta = json.loads(members.pop(META).tobytes().decode())
        entries = meta["entries"]
        assert meta["format"] == FORMAT
        version = int(meta["version"])
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({e!r})") from e
    if version > VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this graphdist "
                              f"reads ({VERSION}); upgrade graphdist")
    for key, entry in entries.items():
        got = members.get(key)
        if got is not None and entry.get("bits") is not None:   # bfloat16 kept as its bits
            if got.dtype.name != entry["bits"] or entry.get("dtype") not in _BITS:
                raise CheckpointError(f"{path}: corrupt entry '{key}': the metadata says "
                                      f"{entry.get('dtype')} stored as {entry['bits']}, the "
                                      f"data is {got.dtype.name}")
            members[key] = got = got.view(as_dtype(entry["dtype"]))
        if got is None or got.shape != tuple(entry["shape"]) or got.dtype.name != entry["dtype"]:
            found = "missing" if got is None else _describe(got.shape, got.dtype)
            raise CheckpointError(f"{path}: corrupt entry '{key}': the metadata says "
                                  f"{_describe(entry['shape'], entry['dtype'])}, the data is "
                                  f"{found}")
    return members


__all__ = ["Checkpoint", "CheckpointError"]
