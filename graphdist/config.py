"""Process-wide settings users change at run time (`gd.config.*`)."""

from __future__ import annotations

import logging
import os

_state = {"explain_retraces": False, "fused_kernels": True, "logical_devices": {},
          "collective_timeout": 60.0, "overlap": True, "device_concurrency": "auto",
          "background_compile": os.environ.get("GRAPHDIST_BACKGROUND_COMPILE", "1") != "0",
          "check_numerics": os.environ.get("GRAPHDIST_CHECK_NUMERICS", "0") not in ("", "0")}

logger = logging.getLogger("graphdist")


def explain_retraces(enabled: bool = True) -> None:
    """Log, on each retrace of a `gd.function`, which part of the signature changed.

    >>> gd.config.explain_retraces(True)
    """
    _state["explain_retraces"] = bool(enabled)


def check_numerics(enabled: bool = True) -> None:
    """Check every floating-point node's output in compiled steps (also
    GRAPHDIST_CHECK_NUMERICS=1): the first NaN or Inf raises gd.NumericsError naming the op,
    the device, the user's source line and which inputs were finite, and the step changes
    no state (TF's tf.debugging.enable_check_numerics, JAX's jax_debug_nans). Steps called
    afterwards run a checked program, compiled once per signature (see docs/benchmarks.md
    for its cost).

    >>> gd.config.check_numerics(True)
    """
    _state["check_numerics"] = bool(enabled)


def numerics_checked() -> bool:
    """Whether compiled steps check for NaN and Inf (check_numerics)."""
    return _state["check_numerics"]


def set_fused_kernels(enabled: bool) -> None:
    """Run optimizer updates as fused multi-tensor kernels and the ops with a listed kernel
    (layer_norm, gelu, relu_grad, max_pool2d...) as their Numba kernels (True), or all of
    them as numpy ops (False)."""
    _state["fused_kernels"] = bool(enabled)


def fused_kernels() -> bool:
    return _state["fused_kernels"]


def set_overlap(enabled: bool) -> None:
    """Start each gradient bucket's all-reduce as soon as its gradients exist and wait for
    it where its result is first used, while the backward pass goes on (True, the default;
    runtime/overlap.py), or run every collective inline, where the step computed it
    (False). Results are bit-identical either way (the same sums in the same order)."""
    _state["overlap"] = bool(enabled)


def overlap() -> bool:
    return _state["overlap"]


def set_background_compile(enabled: bool) -> None:
    """Start a new program on the numpy forms of its Numba kernels while a background
    thread loads (or, with a cold cache, compiles) the kernels, then switch to them (True,
    the default; results are bit-identical either way); or load every kernel before the
    first call returns (False; also GRAPHDIST_BACKGROUND_COMPILE=0)."""
    _state["background_compile"] = bool(enabled)


def background_compile() -> bool:
    return _state["background_compile"]


# the registered device kinds: device/backends.py declares each (config sits below device/)
_device_kinds: list[str] = []


def declare_device_kind(kind: str) -> None:
    _device_kinds.append(kind)


def forget_device_kind(kind: str) -> None:
    _device_kinds.remove(kind)
    _state["logical_devices"].pop(kind, None)


def set_logical_device_count(kind: str, n: int) -> None:
    """Split the physical devices of `kind` into `n` logical devices (round robin)."""
    if kind not in _device_kinds:
        raise ValueError(f"set_logical_device_count: kind must be one of "
                         f"{', '.join(map(repr, _device_kinds))}, got {kind!r}")
    if int(n) < 1:
        raise ValueError(f"set_logical_device_count: n must be >= 1, got {n}")
    _state["logical_devices"][kind] = int(n)


def set_collective_timeout(seconds: float) -> None:
    """How long a collective waits for its peers before raising instead of hanging."""
    if seconds <= 0:
        raise ValueError(f"set_collective_timeout: seconds must be > 0, got {seconds}")
    _state["collective_timeout"] = float(seconds)


def collective_timeout() -> float:
    return _state["collective_timeout"]


def logical_device_count(kind: str) -> int | None:
    return _state["logical_devices"].get(kind)


DEVICE_CONCURRENCY = ("auto", "merged", "sequential", "threads")


def set_device_concurrency(mode: str) -> None:
    """How a replicated step runs its replicas: one copy per device with the collectives
    between them, what the replicated graph, its views and the profile show, issued as
    follows.

    "threads": on CPU devices, one worker thread per device, each running its device's
    program, events between them; with more devices than cores, one thread per core, each
    running its share of the devices as one program (their nodes in the replicated graph's
    order: the tutorial CNN's step on 4 replicas and 2 cores 19.3-21.6 -> 17.3 ms, the
    threads' hand-offs and time slices gone).

    "sequential": device after device from one program in the calling thread (where the
    all-reduce and every replica's update fuse into one node).

    "auto" (the default): "threads" on logical CPU devices within one process (measured
    0.67-0.80x the sequential step for the GPT-2-style and tutorial CNN steps on 4
    replicas, the MLP 0.87-1.08x: docs/benchmarks.md); "sequential" across MPI workers,
    with sharded optimizer state (zero_stage > 0: its fused node needs one program) and
    for a step of small nodes (under 128 KiB a node on average by the cost model: a
    recurrent layer's, a small MLP's; their device threads would contend for the
    interpreter lock). Steps on GPUs always run per device from one thread, each device
    on its own stream.

    "merged" (opt-in, logical CPU devices only): the replicas as one program over values
    stacked on a replica axis (one big GEMM instead of one per device, one optimizer update
    for all); every view then says so, and a step that cannot merge runs per device.

    Applies to steps compiled afterwards.
    """
    if mode not in DEVICE_CONCURRENCY:
        raise ValueError(f"set_device_concurrency: mode must be one of {DEVICE_CONCURRENCY}, "
                         f"got {mode!r}")
    _state["device_concurrency"] = mode


def device_concurrency() -> str:
    return _state["device_concurrency"]


PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
_state["precision"] = "float32"


def set_precision(policy: str) -> None:
    """The global dtype policy (Keras's set_global_policy) of the gd.nn layers made afterwards
    without a `dtype=`: "float32", or "mixed_bfloat16" / "mixed_float16": float32 variables
    (master weights, and so float32 optimizer slots), computation in the low precision with
    float32 accumulation. With "mixed_float16" wrap the optimizer in
    gd.optimizers.LossScaleOptimizer. gd.function keys its traces on the policy.

    >>> gd.config.set_precision("mixed_bfloat16")
    """
    if policy not in PRECISIONS:
        raise ValueError(f"set_precision: policy must be one of {PRECISIONS}, got {policy!r}")
    _state["precision"] = policy


def precision() -> str:
    """The global dtype policy's name (set_precision)."""
    return _state["precision"]
