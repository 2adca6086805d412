"""Compile me if called eagerly: the one way code below gd.function's layer compiles itself.

value_and_grad, strategy.run, strategy.experimental_run_steps and a multi-worker strategy's
eager reduce work in traced code, and when called outside a trace they trace and compile
themselves with gd.function. They ask this module for it, never graphdist.function: that
module sits above them (it drives trace -> pipeline -> runtime and reads the strategy), so
importing it from below would close an import circle. graphdist.function registers
gd.function here when it is imported, which `import graphdist` always does first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping

_compile: Callable | None = None


def register(compile_fn: Callable) -> None:
    """Set what `compiled` wraps a function in: gd.function (graphdist.function calls this)."""
    global _compile
    _compile = compile_fn


def compiled(cache: MutableMapping, key: Hashable, fn: Callable, *, quiet: bool = False):
    """cache[key], or else `fn` wrapped in gd.function and remembered there: the compiled
    form of traced code called eagerly, traced at its first call once per input signature
    as any gd.function. The caller's cache keeps one per key (per replica function, per
    reduce), so a later call with the same key reuses its compiled programs. `quiet`: the
    function is graphdist's own and retraces for every new shape by design (an eager
    reduce across workers), so its retraces are not worth a warning to the user."""
    found = cache.get(key)
    if found is None:
        if _compile is None:
            raise RuntimeError("graphdist.function is not imported, so nothing can compile "
                               "eager code: import graphdist first")
        found = cache[key] = _compile(fn)
        found.warns_on_retraces = not quiet
    return found


__all__ = ["compiled", "register"]
