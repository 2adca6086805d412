"""The kernel registry's entries and how they are registered: one `KernelEntry` per (device
kind, op), made where its adapter is written (runtime/adapters/*.py), as
`jax.interpreters.mlir.register_lowering(prim, rule, platform=)` is. Which entry runs when
(fused kernels on or off, a program's deferred first calls, operand dtypes) is the lookup
policy of runtime/kernel_table.py, which imports every family of adapters and so is the
registry's front: code outside runtime/adapters/ asks it, not this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass


class _OpImpl:
    """The numpy twin that is the op's own generic impl (its `out_impl`, or `impl`): the
    twin of a kernel that computes the same float operations in the same order as numpy."""

    def __repr__(self) -> str:
        return "OP_IMPL"


OP_IMPL = _OpImpl()


@dataclass(frozen=True)
class KernelEntry:
    """How a device kind runs one op faster than the op's generic impl.

    kernel:    `kernel(*inputs, **params)` updating in place the inputs `op.inplace` names
               (the optimizer updates), or, for a collective with several outputs,
               `kernel(outs, *inputs, **params)`;
    out:       `out(out, *inputs, **params)` writing into `out` (or a tuple of outputs), in
               place of the op's generic `out_impl`; it must handle `out` being an input
               where the op allows aliasing;
    numpy, numpy_out: their numpy twins (same calling convention; OP_IMPL: the op's own
               impl), run where the kernel does not: fused kernels off (in-place updates),
               a program's first calls while its kernels load (runtime/warmup.py);
    exact:     the twins give the kernel's bits (the same float operations in the same
               order), so the warm-up may run them first without changing any result;
    reduces:   its work scales with its inputs, not its output (a filter gradient: 1 KiB
               from 22 MB), so it runs for a small output the program keeps too when the
               inputs are big (a small kept value otherwise runs the op's impl: a kernel
               call costs ~8 us more on 8 floats).
    """

    op: str
    kind: str
    kernel: Callable | None = None
    out: Callable | None = None
    numpy: Callable | _OpImpl | None = None
    numpy_out: Callable | _OpImpl | None = None
    exact: bool = False
    reduces: bool = False

    def __post_init__(self):
        where = f"kernel entry ({self.kind!r}, {self.op!r})"
        if self.kernel is None and self.out is None:
            raise ValueError(f"{where}: needs a kernel or an out= kernel")
        if self.kernel is None and self.numpy is not None or \
                self.out is None and self.numpy_out is not None:
            raise ValueError(f"{where}: a numpy twin of a form it does not have")
        if self.exact and (self.kernel is not None and self.numpy is None
                           or self.out is not None and self.numpy_out is None):
            raise ValueError(f"{where}: exact=True needs a numpy twin of each form "
                             "(OP_IMPL: the op's own impl gives the kernel's bits)")

    def twins(self) -> tuple:
        """The twins that are functions of their own (not OP_IMPL)."""
        return tuple(t for t in (self.numpy, self.numpy_out) if callable(t))

    def replace(self, **changes) -> KernelEntry:
        return dataclasses.replace(self, **changes)


# (kind, op name) -> its entry. Registered at import by the adapter modules.
ENTRIES: dict[tuple[str, str], KernelEntry] = {}


def register(entry: KernelEntry, *, replace: bool = False) -> KernelEntry:
    """Add `entry`; one per (kind, op): another for the same pair is an error unless
    `replace` (a test or benchmark swapping a kernel; unregister_kernel puts nothing back)."""
    _check_op(entry.op)
    key = (entry.kind, entry.op)
    if key in ENTRIES and not replace:
        raise ValueError(f"a {entry.kind!r} kernel for op {entry.op!r} is already registered "
                         f"({_name(ENTRIES[key])}); pass replace=True to swap it")
    ENTRIES[key] = entry
    return entry


def register_kernel(op: str, *, kind: str, out: bool = False, numpy=None, exact: bool = False,
                    reduces: bool = False, replace: bool = False):
    """Decorator registering the decorated adapter as `op`'s kernel on device kind `kind`:
    its in-place form, or with out=True its out= form; `numpy` is that form's numpy twin
    (OP_IMPL: the op's impl), `exact` says the twin gives the kernel's bits and `reduces`
    that it runs for small outputs too (KernelEntry)."""
    def add(fn: Callable) -> Callable:
        forms = dict(out=fn, numpy_out=numpy) if out else dict(kernel=fn, numpy=numpy)
        register(KernelEntry(op, kind, exact=exact, reduces=reduces, **forms),
                 replace=replace)
        return fn

    return add


def unregister_kernel(op: str, *, kind: str) -> KernelEntry:
    """Remove and return (kind, op)'s entry: the op then runs its generic impl there."""
    try:
        return ENTRIES.pop((kind, op))
    except KeyError:
        raise KeyError(f"no {kind!r} kernel is registered for op {op!r}") from None


def _check_op(name: str) -> None:
    from graphdist.ops import OPS

    if name not in OPS:
        raise ValueError(f"cannot register a kernel for op {name!r}: no op has that name "
                         "(graphdist.ops.OPS)")


def _name(entry: KernelEntry) -> str:
    fn = entry.kernel or entry.out
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
