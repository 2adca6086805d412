"""Which strategy is current and whether we are in a replica or cross-replica context.

The stack holds (strategy, replica_context) pairs: `strategy.scope()` pushes
(strategy, None), i.e. cross-replica context; `strategy.run` pushes a ReplicaContext. The
default strategy's scope pushes its default replica context: inside it everything is as
outside any scope (TF's "mostly a no-op" default scope).
"""

from __future__ import annotations

import threading

_local = threading.local()
# () -> the default strategy: distribute/strategy.py registers it when imported (the
# strategies are built on this module, so it cannot import them)
_default_strategy = None


def register_default(default_strategy) -> None:
    global _default_strategy
    _default_strategy = default_strategy


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def entered(strategy, replica_context=None) -> _Scope:
    """`with entered(strategy, replica_context):` makes them current (None: cross-replica
    context)."""
    return _Scope(strategy, replica_context)


class _Scope:
    """A reusable, re-entrant context manager, as TF's scope objects: `strategy.scope()` can
    be entered again after it was left, and inside itself (TF's distribute_lib_test.py
    testSameScopeNesting); a generator-based one fails on its second `with`."""

    def __init__(self, strategy, replica_context=None):
        self.strategy, self.replica_context = strategy, replica_context

    def __enter__(self):
        stack = _stack()
        if stack and stack[-1][0] is not self.strategy and not _is_default(stack[-1][0]):
            raise mixing_error(f"cannot enter {self.strategy!r} (id {id(self.strategy):#x})",
                               stack[-1][0], "leave the outer strategy's scope first")
        stack.append((self.strategy, self.replica_context))
        return self.strategy

    def __exit__(self, *exc) -> None:
        _stack().pop()


def mixing_error(what: str, current, advice: str) -> RuntimeError:
    """TF's "Mixing different tf.distribute.Strategy objects" error."""
    return RuntimeError(f"Mixing different gd.distribute strategies: {what} inside the scope "
                        f"or run of another strategy object, {current!r} (id "
                        f"{id(current):#x}); {advice}")


def require_current(strategy, what: str) -> None:
    """Using one strategy's values (its variables, its reduce) inside the scope or run of
    another raises, as in TF; outside any strategy, or inside its own, it is fine."""
    stack = _stack()
    if not stack or stack[-1][0] is strategy or _is_default(strategy) \
            or _is_default(stack[-1][0]):
        return
    from graphdist.errors import user_frame_text

    where = user_frame_text()
    raise mixing_error(f"{what} of {strategy!r} (id {id(strategy):#x}) used", stack[-1][0],
                       "use it inside its own strategy's scope or run, or outside every "
                       "scope" + (f"\n  at  {where}" if where else ""))


def get_strategy():
    """The strategy of the innermost scope or `run`, else the default one-device strategy."""
    stack = _stack()
    if stack:
        return stack[-1][0]
    return _default_strategy()


def _is_default(strategy) -> bool:
    return strategy is _default_strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope() or run(): as in TF, the current strategy
    is not the default one (so False in the default strategy's merge_fn, say)."""
    stack = _stack()
    return bool(stack) and not _is_default(stack[-1][0])


def get_replica_context():
    """The ReplicaContext inside `strategy.run` (and outside any strategy, the default one);
    None in cross-replica context (inside scope(), outside run, and inside merge_fn)."""
    stack = _stack()
    if stack:
        return stack[-1][1]
    return _default_strategy().default_replica_context


def in_cross_replica_context() -> bool:
    stack = _stack()
    return bool(stack) and stack[-1][1] is None
