"""Which strategy is current and whether we are in a replica or cross-replica context.

The stack holds (strategy, replica_context) pairs: `strategy.scope()` pushes
(strategy, None), i.e. cross-replica context; `strategy.run` pushes a ReplicaContext.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def entered(strategy, replica_context=None):
    stack = _stack()
    if stack and stack[-1][0] is not strategy and not _is_default(stack[-1][0]):
        raise RuntimeError(f"Mixing different gd.distribute strategies: cannot enter {strategy!r} "
                           f"(id {id(strategy):#x}) inside the scope or run of another "
                           f"strategy object, {stack[-1][0]!r} (id {id(stack[-1][0]):#x}); "
                           "leave the outer strategy's scope first")
    stack.append((strategy, replica_context))
    try:
        yield strategy
    finally:
        stack.pop()


def get_strategy():
    """The strategy of the innermost scope or `run`, else the default one-device strategy."""
    stack = _stack()
    if stack:
        return stack[-1][0]
    from graphdist.distribute.strategy import default_strategy

    return default_strategy()


def _is_default(strategy) -> bool:
    from graphdist.distribute.strategy import default_strategy

    return strategy is default_strategy()


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
    from graphdist.distribute.strategy import default_strategy

    return default_strategy().default_replica_context


def in_cross_replica_context() -> bool:
    stack = _stack()
    return bool(stack) and stack[-1][1] is None
