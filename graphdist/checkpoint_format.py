"""The checkpoint file: a zip of `.npy` entries and a JSON `__meta__` entry, what np.savez
writes (no pickle), written atomically and read as untrusted input.

A checkpoint may come from elsewhere, so reading one trusts nothing it declares. The file
must be a regular file (a FIFO or a device would block or never end); the zip directory
is read first and names no member twice; the metadata is bounded in size and checked
field by field; an entry is decompressed only when the caller asks for it (restore asks
only for what it tracks), after its declared sizes (metadata, .npy header, zip directory)
agree with each other and with what the caller expects, and it is read in bounded chunks
from a stored or deflated member (the other zip methods decompress without a bound).
Every way a file can be wrong is a CheckpointError naming the file and the entry.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import stat
import struct
import time
import uuid
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

from graphdist.errors import CheckpointError
from graphdist.ir.types import as_dtype

FORMAT, VERSION, META = "graphdist.checkpoint", 1, "__meta__"
BITS = {"bfloat16": "uint16"}      # dtypes stored as raw bits: the .npy header cannot name them
MAX_META_BYTES = 64 << 20          # ~400,000 entries' worth of metadata
MAX_NDIM = 64
MAX_HEADER_BYTES = 10_000          # numpy's own bound on a .npy header
CHUNK = 1 << 20                    # decompress at most this much per read
_READABLE = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
# what zipfile, zlib and the file system raise on damaged input
_DAMAGE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, struct.error,
           RuntimeError, NotImplementedError)
_MISSING = object()                # a metadata key that is absent (as opposed to null)
_KINDS = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)",
          stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
          stat.S_ISSOCK: "a socket"}


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as the metadata declares it: shape, dtype (bfloat16 for one stored as its
    bits), the dtype its .npy holds, and its zip member."""

    key: str
    shape: tuple
    dtype: np.dtype
    stored: np.dtype
    member: zipfile.ZipInfo

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.stored.itemsize


def describe(shape, dtype) -> str:
    return f"shape {tuple(shape)} dtype {np.dtype(dtype).name}"


# ---------------------------------------------------------------- reading


class CheckpointFile:
    """An open checkpoint whose directory and metadata are checked; no entry is read yet.

    >>> with CheckpointFile(path) as f:
    ...     w = f.read("model/w")
    """

    def __init__(self, path: str):
        self.path = path
        self._file, self._zip = _open_regular(path), None
        try:
            try:
                self._zip = zipfile.ZipFile(self._file)
            except _DAMAGE as e:
                raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({e})") from e
            members = _members(self._zip, path)
            meta = self._meta(members)
            self.entries = _entries(meta, members, path)
            self.optimizers = _optimizers(meta, path)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
        self._file.close()

    def _meta(self, members) -> dict:
        member = members.pop(META, None)
        if member is None:
            raise CheckpointError(f"{self.path}: not a graphdist checkpoint (no {META} entry)")
        declared = member.file_size
        if declared > MAX_META_BYTES:
            raise CheckpointError(f"{self.path}: its {META} entry declares {declared} bytes, "
                                  f"more than checkpoint metadata may hold ({MAX_META_BYTES})")
        raw = self._array(META, member, np.dtype(np.uint8), None).tobytes()
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:   # RecursionError: nesting too deep
            raise CheckpointError(f"{self.path}: corrupt checkpoint metadata (not JSON: "
                                  f"{type(e).__name__}: {str(e)[:200]})") from None
        return _checked_meta(meta, self.path)

    def read(self, key: str) -> np.ndarray:
        """Entry `key` as an array of its declared shape and dtype (only now decompressed)."""
        entry = self.entries[key]
        value = self._array(key, entry.member, entry.stored, entry.shape)
        return value.view(entry.dtype) if entry.dtype != entry.stored else value

    def _array(self, key, member, dtype, shape) -> np.ndarray:
        where = f"{self.path}: entry '{key}'"
        if member.compress_type not in _READABLE:
            raise CheckpointError(f"{where} is compressed with zip method "
                                  f"{member.compress_type}; checkpoints are read from stored "
                                  "or deflated members only")
        try:
            with self._zip.open(member) as stream:
                got_shape, fortran, got_dtype = _npy_header(stream, where)
                _check_header(where, got_shape, got_dtype, shape, dtype)
                nbytes = math.prod(got_shape) * got_dtype.itemsize
                if stream.tell() + nbytes != member.file_size:
                    raise CheckpointError(
                        f"{where}: its .npy declares {describe(got_shape, got_dtype)} "
                        f"({nbytes} bytes of data), the zip member holds "
                        f"{member.file_size - stream.tell()}")
                data = _read_exactly(stream, nbytes, where)
        except CheckpointError:
            raise
        except _DAMAGE as e:
            raise CheckpointError(f"{where}: truncated or corrupt ({e})") from e
        order = "F" if fortran else "C"
        return data.view(got_dtype).reshape(got_shape, order=order)


def _open_regular(path: str):
    """The file at `path` opened for reading, refused unless it is a regular file (checked
    on the open descriptor: a FIFO opened without O_NONBLOCK would wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: not a regular file (a folder)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the checkpoint ({e.strerror})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS.items() if test(mode)), "not a file")
        raise CheckpointError(f"{path}: not a regular file ({kind}); a checkpoint is a file")
    return os.fdopen(fd, "rb")


def _members(zf, path) -> dict:
    """{entry key: zip member}; a key named twice (`w.npy` twice, or `w` and `w.npy`) is
    refused: which copy a reader loads would be up to the reader."""
    members = {}
    for info in zf.infolist():
        key = info.filename.removesuffix(".npy")
        if key in members:
            raise CheckpointError(f"{path}: the zip member '{info.filename}' appears twice "
                                  f"(as '{members[key].filename}' before); a checkpoint "
                                  "names each entry once")
        members[key] = info
    return members


def _npy_header(stream, where):
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(stream, MAX_HEADER_BYTES)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(stream, MAX_HEADER_BYTES)
    except (ValueError, SyntaxError, TypeError, KeyError) as e:   # numpy's header parser
        raise CheckpointError(f"{where}: not a valid .npy array ({e})") from None
    raise CheckpointError(f"{where}: .npy format version {version} is not one checkpoints use")


def _check_header(where, shape, dtype, want_shape, want_dtype) -> None:
    """The .npy header against what the metadata declares (`want_shape` None: any 1-d)."""
    if dtype.hasobject:
        raise CheckpointError(f"{where} holds Python objects (dtype {dtype}); checkpoints hold "
                              "numbers only and never unpickle")
    if dtype != want_dtype and dtype.newbyteorder("=") == want_dtype:
        order = {">": "big", "<": "little"}
        raise CheckpointError(f"{where} is stored {order[dtype.byteorder]}-endian "
                              f"({dtype.str}); this build reads "
                              f"{order[want_dtype.str[0]]}-endian ({want_dtype.str})")
    if want_shape is None:
        if dtype != want_dtype or len(shape) != 1:
            raise CheckpointError(f"{where}: expected bytes (a 1-d {want_dtype} array), its "
                                  f".npy holds {describe(shape, dtype)}")
    elif dtype != want_dtype or tuple(shape) != tuple(want_shape):
        raise CheckpointError(f"{where}: the metadata says {describe(want_shape, want_dtype)}, "
                              f"its .npy holds {describe(shape, dtype)}")


def _read_exactly(stream, nbytes: int, where) -> np.ndarray:
    """`nbytes` bytes in chunks (each decompression step bounded), then the end of the member
    (where zipfile checks the CRC)."""
    data = np.empty(nbytes, np.uint8)
    view, done = memoryview(data), 0
    while done < nbytes:
        chunk = stream.read(min(CHUNK, nbytes - done))
        if not chunk:
            raise CheckpointError(f"{where}: truncated ({done} of {nbytes} bytes of data)")
        view[done:done + len(chunk)] = chunk
        done += len(chunk)
    if stream.read(1):
        raise CheckpointError(f"{where}: more data than its shape holds")
    return data


# ---------------------------------------------------------------- metadata


def _checked_meta(meta, path) -> dict:
    bad = f"{path}: corrupt checkpoint metadata"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{bad}: {_shown(meta)} instead of an object")
    if meta.get("format", _MISSING) != FORMAT:
        raise CheckpointError(f"{path}: not a graphdist checkpoint (format "
                              f"{_shown(meta.get('format', _MISSING))}, expected {FORMAT!r})")
    version = meta.get("version", _MISSING)
    if not _is_int(version) or version < 1:
        raise CheckpointError(f"{bad}: version must be a positive integer, got "
                              f"{_shown(version)}")
    if version > VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this graphdist "
                              f"reads ({VERSION}); upgrade graphdist")
    if not isinstance(meta.get("entries", _MISSING), dict):
        raise CheckpointError(f"{bad}: 'entries' must be an object, got "
                              f"{_shown(meta.get('entries', _MISSING))}")
    return meta


def _shown(value) -> str:
    """A metadata value as the JSON it came from, cut short: what an error message quotes."""
    if value is _MISSING:
        return "nothing"
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entries(meta, members, path) -> dict:
    entries = {}
    for key, fields in meta["entries"].items():
        member = members.get(key)
        where = f"{path}: entry '{key}'"
        if member is None:
            raise CheckpointError(f"{where} is in the metadata but not in the file")
        entries[key] = entry = _entry(key, fields, member, where)
        if entry.nbytes > member.file_size:
            declared = describe(entry.shape, entry.dtype)
            raise CheckpointError(f"{where}: the metadata says {declared} ({entry.nbytes} "
                                  f"bytes), its zip member holds {member.file_size}")
    unlisted = sorted(set(members) - set(entries))
    if unlisted:
        raise CheckpointError(f"{path}: the file holds members the metadata does not list: "
                              f"{', '.join(map(repr, unlisted[:5]))}")
    return entries


def _entry(key, fields, member, where) -> Entry:
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: its metadata must be an object, got "
                              f"{_shown(fields)}")
    shape = fields.get("shape", _MISSING)
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(d) and 0 <= d < 2**63 for d in shape)):
        raise CheckpointError(f"{where}: shape must be a list of at most {MAX_NDIM} "
                              f"non-negative integers, got {_shown(shape)}")
    dtype = _dtype(fields.get("dtype", _MISSING), where)
    stored, bits = dtype, fields.get("bits")
    if bits is not None:
        if BITS.get(dtype.name) != bits:
            raise CheckpointError(f"{where}: the metadata says {dtype.name} stored as "
                                  f"{_shown(bits)}; only {BITS} are stored as bits")
        stored = np.dtype(bits)
    for name, kind in (("synchronization", str), ("aggregation", str), ("components", int)):
        if name in fields and not isinstance(fields[name], kind):
            raise CheckpointError(f"{where}: {name} must be a {kind.__name__}, got "
                                  f"{_shown(fields[name])}")
    return Entry(key, tuple(shape), dtype, stored, member)


def _dtype(name, where) -> np.dtype:
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: dtype must be a dtype name, got {_shown(name)}")
    try:
        dtype = as_dtype(name)
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.name != name:
        raise CheckpointError(f"{where}: dtype {name[:40]!r} is not one graphdist variables "
                              "hold")
    return dtype


def _optimizers(meta, path) -> dict:
    """{optimizer path: {"type": class name, "slots": [slot names]}}; {} for a file from
    before optimizer types were recorded."""
    found = meta.get("optimizers", {})
    if not isinstance(found, dict):
        raise CheckpointError(f"{path}: corrupt checkpoint metadata: 'optimizers' must be an "
                              f"object, got {_shown(found)}")
    for key, info in found.items():
        if not (isinstance(info, dict) and isinstance(info.get("type"), str)
                and isinstance(info.get("slots"), list)
                and all(isinstance(s, str) for s in info["slots"])):
            raise CheckpointError(f"{path}: corrupt checkpoint metadata: optimizer '{key}' "
                                  "must be an object with a 'type' name and a 'slots' list of "
                                  f"names, got {_shown(info)}")
    return found


# ---------------------------------------------------------------- writing

# A save writes `.NAME.HOST.PID.RANDOM.tmp` beside NAME, then renames it over NAME. A save
# killed part-way leaves that temp file behind; the next save to NAME removes the stale ones:
# of a dead process on this host, or (any host, or the older `.NAME.RANDOM.tmp` form)
# untouched for STALE_TEMP_S, longer than any save goes without writing. A concurrent save's
# temp file (a live process, recently written) is left alone.
STALE_TEMP_S = 30 * 60
HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"


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
        dead = m["host"] == HOST and not _pid_alive(int(m["pid"]))
        if old or dead:
            try:
                os.unlink(full)
                removed.append(full)
            except OSError:
                pass
    return removed


def check_destination(path: str) -> None:
    """A CheckpointError naming the folder when `path` cannot be written as a new file."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise CheckpointError(f"cannot save the checkpoint to {path!r}: it is a folder; give "
                              "a file name inside it")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise CheckpointError(f"cannot save the checkpoint {path!r}: the folder {folder!r} "
                              f"{what}; create it first")


def write_atomically(path: str, arrays: dict) -> None:
    """Write {key: array} as `path` (entries `key.npy`, as np.savez): a temp file beside it,
    fsynced, renamed over `path`; on any failure the temp file is removed."""
    check_destination(path)
    remove_stale_temps(path)
    # temp file in the target's directory (os.replace must not cross filesystems), created
    # with mode 0o666 so the umask applies as for any new file
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{HOST}."
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
    _sync_folder(os.path.dirname(path) or ".")


def _sync_folder(folder: str) -> None:
    """Make the rename itself durable."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
