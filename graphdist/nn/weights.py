"""model.save_weights / load_weights: `.safetensors` files (the format the Hugging Face
ecosystem loads, through the `safetensors` package) or, for any other suffix, the
checkpoint format (gd.Checkpoint with the model alone).

A safetensors file is a JSON header (names, dtypes, shapes, byte offsets) and raw bytes:
reading one runs no code from it. Keys are the variables' structural paths, as checkpoints
name them (`layers/0/kernel`, a subclassed model's `dense1/bias`), so another instance of
the same architecture loads them whatever its layers were named. Loading reads and checks
every entry (name, shape, dtype) before it writes any variable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np

from graphdist.checkpoint import Checkpoint
from graphdist.errors import CheckpointError
from graphdist.variables import Variable

SUFFIX = ".safetensors"


def _safetensors():
    try:
        import safetensors.numpy as st
    except ImportError:
        raise ImportError("model.save_weights/load_weights of a .safetensors file need the "
                          "safetensors package: pip install 'graphdist[safetensors]' (or "
                          "use another suffix for the checkpoint format)") from None
    return st


def model_variables(model) -> dict:
    """{structural path: Variable} of the model's weights, in checkpoint order."""
    found: dict = {}
    seen: set = set()

    def walk(obj, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Variable):
            found[path] = obj
            return
        children = obj._checkpoint_children() if hasattr(obj, "_checkpoint_children") else \
            enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        for key, child in children:
            walk(child, f"{path}/{key}" if path else str(key))

    walk(model, "")
    return found


def _is_chief(model) -> bool:
    strategy = getattr(model, "distribute_strategy", None)
    return bool(getattr(strategy, "is_chief", True))


def save_weights(model, path) -> str:
    """Write the model's variables to `path` (atomically); returns the path."""
    path = os.fspath(path)
    if not path.endswith(SUFFIX):
        return Checkpoint(model=model).save(path)
    st = _safetensors()
    arrays = {key: np.ascontiguousarray(v.numpy()) for key, v in model_variables(model).items()}
    if not _is_chief(model):
        return path
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        st.save_file(arrays, temp, metadata={"format": "graphdist", "model": type(model).__name__})
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
    return path


def load_weights(model, path) -> None:
    """Read `path` into the model's variables, every one checked before any is written."""
    path = os.fspath(path)
    if not path.endswith(SUFFIX):
        Checkpoint(model=model).restore(path).assert_consumed()
        return
    st = _safetensors()
    variables = model_variables(model)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such weights file")
    try:
        arrays = st.load_file(path)
    except Exception as e:  # noqa: BLE001 - the package's own error types vary by version
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                              f"{e})") from None
    missing = [k for k in variables if k not in arrays]
    extra = [k for k in arrays if k not in variables]
    if missing or extra:
        raise CheckpointError(f"{path}: the file does not fit {type(model).__name__} "
                              f"'{model.name}': " + "; ".join(
                                  part for part in (
                                      f"missing {missing[:8]}" if missing else "",
                                      f"not in the model {extra[:8]}" if extra else "")
                                  if part))
    for key, v in variables.items():
        a = arrays[key]
        if a.shape != v.shape or a.dtype != v.dtype:
            raise CheckpointError(f"{path}: entry '{key}' is {a.dtype}{list(a.shape)}, the "
                                  f"variable '{v.name}' is {v.dtype}{list(v.shape)}")
    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        for key, v in variables.items():
            v.assign_components(v.components_for(arrays[key]))


__all__ = ["load_weights", "model_variables", "save_weights"]
