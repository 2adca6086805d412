"""Which kernel runs an op on which device kind: the kernel registry and its lookup policy.

An op's block in graphdist/ops says what the op means, with a numpy/CuPy impl that works
on any backend. Where a device kind has a faster kernel for it, one entry says so
(runtime/adapters/registry.py's `KernelEntry`: the kernel, in place or out=, its numpy
twin, whether the twin gives the kernel's bits), registered beside its adapter:

    @register_kernel("relu_grad", kind="cpu", out=True, numpy=OP_IMPL, exact=True)
    def relu_grad_cpu(out, ct, y): ...

The adapters live by family in runtime/adapters/ (optim, collectives, nn, sparse,
accumulate); this module imports them all, so every entry is registered once it is loaded.
The policy below decides which form runs:

- operands of a dtype the Numba kernels do not compile (float16, bfloat16): the op's
  generic impl;
- fused kernels off (`gd.config.set_fused_kernels(False)`): an in-place update runs its
  numpy twin, and an out= kernel gives way to the op's generic out_impl, except for
  collectives (whose CPU lowering the kernel is);
- deferred (a program's first calls while its kernels load, runtime/warmup.py): an op
  with an exact entry runs its numpy twin (OP_IMPL, or none listed for this kind: the
  op's generic impl);
- else the kernel.

Kernels come from graphdist.kernels (Numba, CPU and CUDA) and are imported only when a
program that uses them is lowered: importing the registry loads neither Numba nor CuPy.
"""

from __future__ import annotations

import functools

from graphdist.ir.types import LOW_PRECISION
from graphdist.runtime.adapters import (  # noqa: F401 - registers
    accumulate, collectives, nn, optim, sparse)
from graphdist.runtime.adapters import epilogue  # noqa: F401 - registers (fused epilogues)
from graphdist.runtime.adapters import fused  # noqa: F401 - registers (fused elementwise)
from graphdist.runtime.adapters.collectives import host_all_reduce_cpu  # noqa: F401 - simulate
from graphdist.runtime.adapters.registry import (  # noqa: F401 - the registry's front
    ENTRIES,
    OP_IMPL,
    KernelEntry,
    register,
    register_kernel,
    unregister_kernel,
)


def entry(kind: str, op_name: str) -> KernelEntry | None:
    """The registered entry for `op_name` on device kind `kind`, if any."""
    return ENTRIES.get((kind, op_name))


def exact_ops() -> frozenset:
    """The ops whose numpy form (an entry's twin, else the op's generic impl) computes the
    same float operations in the same order as their kernel, so either gives the same bits
    (tests/runtime/test_warmup.py checks each on whole training steps): a deferred program runs
    those forms on every device kind while the kernels load."""
    return frozenset(e.op for e in ENTRIES.values() if e.exact)


def is_numpy_twin(fn) -> bool:
    """Whether `fn` is some entry's numpy twin: nothing for the warm-up to load."""
    return any(fn is twin for e in ENTRIES.values() for twin in e.twins())


def kernel(backend, op, types=(), *, fused: bool = True, deferred: bool = False):
    """The in-place kernel that runs `op` on `backend`'s device kind, for operands of these
    types (ArrayTypes of the inputs and outputs): `kernel(*inputs, **params)` updating the
    inputs `op.inplace` names (or a collective's `kernel(outs, *inputs, **params)`).
    deferred=True for an exact op, or fused=False for an in-place update: its numpy twin
    (same calling convention), if it has one; None: the op's generic impl."""
    found = _entry(backend, op, types)
    if found is None:
        return None
    if deferred and op.name in exact_ops() or not fused and op.inplace:
        return _twin(found.numpy)
    return found.kernel


def out_kernel(backend, op, types=(), *, fused: bool = True, deferred: bool = False):
    """The out= kernel `fn(out, *inputs, **params)` for `op` on `backend`'s device kind and
    these operand types, if any. fused=False passes over the kernels of all but collectives
    (whose CPU lowering the kernel is): every op then runs its numpy form. deferred=True
    passes over those of exact ops, collectives included, to their numpy twin if one is
    listed (else None: the op's generic out_impl)."""
    if not (fused or op.collective):
        return None
    found = _entry(backend, op, types)
    if found is None:
        return None
    if deferred and op.name in exact_ops():
        return _twin(found.numpy_out)
    return found.out


def out_impl(backend, op, types=(), *, fused: bool = True, deferred: bool = False):
    """`fn(out, *inputs, **params)` writing `op`'s result into `out`: the out= kernel the
    policy picks for the backend's device kind (and these operand types), else the op's
    generic out_impl on the backend's array module."""
    fn = out_kernel(backend, op, types, fused=fused, deferred=deferred)
    if fn is None and op.out_impl is not None:
        fn = functools.partial(op.out_impl, backend.xp)
    return fn


def reduces(backend, op, types=()) -> bool:
    """Whether `op`'s kernel on `backend`'s device kind does work that scales with its
    inputs rather than its output (KernelEntry.reduces): the plan runs it for small outputs
    too."""
    found = _entry(backend, op, types)
    return found is not None and found.reduces


def _entry(backend, op, types) -> KernelEntry | None:
    if not _compiled_dtypes(types):
        return None
    return ENTRIES.get((backend.kernel_kind, op.name))


def _compiled_dtypes(types) -> bool:
    # the Numba kernels compile for float32/float64 (and ints, bool): float16 and bfloat16
    # operands take the op's generic numpy impl
    return not any(t.dtype in LOW_PRECISION for t in types)


def _twin(form):
    """A twin as the lowering calls it: OP_IMPL is the op's generic impl (None here)."""
    return None if form is OP_IMPL else form
