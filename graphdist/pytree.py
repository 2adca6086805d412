"""Flattening nested tuples, lists, dicts and PerReplica values into leaves and back."""

from __future__ import annotations

from graphdist.distribute.values import PerReplica


def flatten(x, path: str = "", leaf_types: tuple = ()) -> tuple[list, list, object]:
    """(leaves, their paths, treedef); treedef is hashable and rebuilds the structure.
    Instances of `leaf_types` are leaves even when they are containers."""
    leaves, paths = [], []
    tree = _flatten(x, path, leaves, paths, leaf_types)
    return leaves, paths, tree


def _flatten(x, path, leaves, paths, leaf_types=()):
    if leaf_types and isinstance(x, leaf_types):
        leaves.append(x)
        paths.append(path)
        return None
    if isinstance(x, PerReplica):
        return (type(x), tuple(_flatten(v, f"{path}.values[{i}]", leaves, paths, leaf_types)
                               for i, v in enumerate(x.tree_children())))
    if isinstance(x, tuple) and hasattr(x, "_fields"):   # namedtuple
        return (type(x), tuple(_flatten(v, f"{path}.{f}", leaves, paths, leaf_types)
                               for f, v in zip(x._fields, x)))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_flatten(v, f"{path}[{i}]", leaves, paths, leaf_types)
                               for i, v in enumerate(x)))
    if isinstance(x, dict):
        keys = tuple(sorted(x, key=repr))
        return (dict, keys, tuple(_flatten(x[k], f"{path}[{k!r}]", leaves, paths, leaf_types)
                                  for k in keys))
    leaves.append(x)
    paths.append(path)
    return None


def unflatten(tree, leaves):
    it = iter(leaves)
    return _unflatten(tree, it)


def _unflatten(tree, it):
    if tree is None:
        return next(it)
    kind = tree[0]
    if kind is dict:
        return {k: _unflatten(t, it) for k, t in zip(tree[1], tree[2])}
    children = [_unflatten(t, it) for t in tree[1]]
    if issubclass(kind, PerReplica):
        return kind(children)
    if hasattr(kind, "_fields"):
        return kind(*children)
    return kind(children)
