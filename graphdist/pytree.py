"""Flattening nested tuples, lists, dicts and per-replica values into leaves and back.

A class whose instances hold children (gd.PerReplica) says so with `tree_children()` and is
rebuilt as `cls(children)`, or, when it also keeps static data (`tree_aux()`, gd.IndexedSlices'
dense shape), as `cls.tree_rebuild(children, aux)`; this module knows no such class by name."""

from __future__ import annotations


def _is_node(x) -> bool:
    return hasattr(type(x), "tree_children")


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
    if _is_node(x):
        children = tuple(_flatten(v, f"{path}.values[{i}]", leaves, paths, leaf_types)
                         for i, v in enumerate(x.tree_children()))
        if hasattr(x, "tree_aux"):        # static data the node keeps (a dense shape)
            return (type(x), children, x.tree_aux())
        return (type(x), children)
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
    if hasattr(kind, "tree_aux"):
        return kind.tree_rebuild(children, tree[2])
    if hasattr(kind, "tree_children"):
        return kind(children)
    if hasattr(kind, "_fields"):
        return kind(*children)
    return kind(children)
