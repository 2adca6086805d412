"""Errors name the function the user called, not the op it is built from.

`gd.stack` binds reshape and concat, `gd.nn.softmax` reduce_max and exp, `gd.cast` checks
a dtype, `gd.nn.embedding_lookup` is a gather. An error one of those raises names its own
op ("concat: dtypes differ"), which the user never called. `@user_op("stack")` marks a
public function as the name for the errors raised while it runs: a TypeError, ValueError
(ShapeError) or IndexError whose message starts with another name is raised again
starting with the user's, the internal op kept at the end of the first line; the rest of
the message (the user's source line, for traced code) is unchanged.

Composites nest (embedding_lookup calls gather, softmax calls cast): the outermost marked
function names the errors. Ops whose check runs later, when a compiled step runs, take the
name as a parameter from `called_as` (gather's index check does), since by then no Python
function of the user's is running.
"""

from __future__ import annotations

import functools
import re
import threading

_RENAMED = (TypeError, ValueError, IndexError)    # ShapeError is a ValueError
_LEADING_NAME = re.compile(r"(\w+): ")


class _Calls(threading.local):
    """The marked functions running in this thread, outermost first (traces are per
    thread, so are the names)."""

    def __init__(self):
        self.names: list[str] = []


_calls = _Calls()


def called_as(default: str) -> str:
    """The name of the outermost marked function running now, else `default`."""
    names = _calls.names
    return names[0] if names else default


def user_op(name: str):
    """Decorator: errors raised while the function runs name `name` (see the module)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            names = _calls.names
            if names:                     # inside another marked function: it names errors
                return fn(*args, **kwargs)
            names.append(name)
            try:
                return fn(*args, **kwargs)
            except _RENAMED as e:
                new = renamed(e, name)
                if new is e:
                    raise
                raise new.with_traceback(e.__traceback__) from None
            finally:
                names.pop()
        return call
    return wrap


def renamed(e: Exception, name: str) -> Exception:
    """`e` with its message's first line starting `name: ` (the same exception when it
    already does, or when its type cannot be rebuilt from a message)."""
    first, newline, rest = str(e).partition("\n")
    if first.startswith(f"{name}:"):
        return e
    inner = _LEADING_NAME.match(first)
    if inner is not None:
        first = f"{name}: {first[inner.end():]} (in {inner.group(1)}, inside {name})"
    else:
        first = f"{name}: {first}"
    try:
        return type(e)(first + newline + rest)
    except Exception:          # an exception class that takes other arguments
        return e
