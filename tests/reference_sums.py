"""Reference sums for the collective tests: the replicas' values added one after another in a
given order, as a lowering adds them, so a lowering's result can be compared bit for bit."""


def add_in_order(parts):
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = acc + p
    return acc


def finish(acc, n, op):
    """A sum, or the mean of n replicas' values, divided in the values' own dtype."""
    return acc / acc.dtype.type(n) if op == "mean" and n > 1 else acc
