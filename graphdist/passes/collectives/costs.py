"""The textbook cost of each collective algorithm: seconds for a collective of S bytes (one
replica's value) on n devices, every device with one link of latency a and bandwidth B
(the alpha-beta model; Hockney 1994). Devices work in parallel: the cost is the critical
path. Reduction arithmetic is not counted (it is memory-bound and overlaps), except where
`add` prices it (logical devices of one host, a worker's local sum).

A link is anything with `latency`, `bandwidth` and `time(nbytes)` (graphdist.simulate's
Link); `None` for `add` means adds are free. Each lowering (lowerings.py) prices its
collectives with these.
"""

from __future__ import annotations

import math


def _time(link, nbytes: float) -> float:
    """latency + S / bandwidth; 0 for no link (free)."""
    return 0.0 if link is None else link.latency + nbytes / link.bandwidth


def ring_cost(n: int, nbytes: float, link) -> float:
    """Reduce-scatter + all-gather around the ring: 2(n-1) steps, each moving S/n bytes
    per link: 2(n-1)/n * S/B + 2(n-1) * a (Patarasuk & Yuan 2009, Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def ring_reduce_scatter_cost(n: int, nbytes: float, link) -> float:
    """The ring's first half: (n-1) steps of S/n bytes: (n-1)/n * S/B + (n-1) * a."""
    return ring_cost(n, nbytes, link) / 2


def one_device_cost(n: int, nbytes: float, link) -> float:
    """Gather to one device and copy back: the root's link carries n-1 messages of S in and
    n-1 out, one after another: 2(n-1) * (a + S/B)."""
    return 2 * (n - 1) * link.time(nbytes) if n > 1 else 0.0


def one_device_reduce_scatter_cost(n: int, nbytes: float, link) -> float:
    """Gather to one device, send each its shard: (n-1) * (a + S/B) + (n-1) * (a + S/nB)."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.time(nbytes) + link.time(nbytes / n))


def hierarchical_cost(n: int, nbytes: float, link, num_groups: int = 2) -> float:
    """As the "hierarchical" lowering: groups of m = ceil(n/g) devices sum onto their
    leader ((m-1) messages into it), the g leaders exchange partials ((g-1) messages into
    each), and each leader copies the result back ((m-1) out): (2(m-1) + g-1) * (a + S/B).
    num_groups=round(sqrt(n)) gives the O(sqrt n) two-level scheme."""
    if n <= 1:
        return 0.0
    g = max(1, min(num_groups, n))
    m = math.ceil(n / g)
    return (2 * (m - 1) + (g - 1)) * link.time(nbytes)


def hierarchical_reduce_scatter_cost(n: int, nbytes: float, link,
                                     num_groups: int = 2) -> float:
    """As the all-reduce, but each leader sends its group only their shards:
    (m-1 + g-1) * (a + S/B) + (m-1) * (a + S/nB)."""
    if n <= 1:
        return 0.0
    g = max(1, min(num_groups, n))
    m = math.ceil(n / g)
    return (m - 1 + g - 1) * link.time(nbytes) + (m - 1) * link.time(nbytes / n)


def host_cost(n: int, nbytes: float, link) -> float:
    """One fused pass over n host buffers (HostAllReduce on logical CPU devices): reads n
    buffers and writes n results: a + n * S / B, with B the calibrated host rate."""
    return link.latency + n * nbytes / link.bandwidth if n > 1 else 0.0


def all_gather_cost(n: int, nbytes: float, link) -> float:
    """Ring all-gather of n pieces of S bytes: (n-1) * (a + S/B) (Thakur et al. 2005)."""
    return (n - 1) * link.time(nbytes) if n > 1 else 0.0


def broadcast_cost(n: int, nbytes: float, link) -> float:
    """Binomial-tree broadcast: ceil(log2 n) * (a + S/B)."""
    return math.ceil(math.log2(n)) * link.time(nbytes) if n > 1 else 0.0


def mpi_cost(n: int, nbytes: float, link, devices_per_worker: int = 1, local=None) -> float:
    """What a MultiWorkerMirroredStrategy all-reduce runs (the "mpi" lowering, one node):
    each worker copies its first replica's S bytes into the result, adds its other k-1
    replicas, all-reduces the sum with MPI between the W = ceil(n/k) workers (a ring, as
    MPICH's large-message all-reduce: ring_cost(W, S, link)), divides for the mean and
    copies the result to its other replicas: local passes touching (5k-1) S bytes, priced
    by `local` (this host's elementwise rate; None: free)."""
    if n <= 1:
        return 0.0
    k = max(1, devices_per_worker)
    return ring_cost(math.ceil(n / k), nbytes, link) + _time(local, (5 * k - 1) * nbytes)


def shared_ring_cost(n: int, nbytes: float, link, add=None) -> float:
    """The ring among n logical devices of one host, where nothing runs in parallel: every
    one of n*2(n-1) copies and n(n-1) adds of S/n is paid."""
    if n <= 1:
        return 0.0
    return (2 * (n - 1) * nbytes / link.bandwidth + 2 * n * (n - 1) * link.latency
            + n * (n - 1) * _time(add, 3 * nbytes / n))


def shared_hierarchical_cost(n: int, nbytes: float, link, num_groups: int = 2,
                             add=None) -> float:
    """Hierarchical among logical devices of one host: 2(n-g) + g(g-1) copies and
    n-g + g(g-1) adds of S, one after another."""
    if n <= 1:
        return 0.0
    g = max(1, min(num_groups, n))
    return ((2 * (n - g) + g * (g - 1)) * link.time(nbytes)
            + (n - g + g * (g - 1)) * _time(add, 3 * nbytes))


def shared_one_device_cost(n: int, nbytes: float, link, add=None) -> float:
    """To one device and back among logical devices of one host: 2(n-1) copies and n-1
    adds of S, one after another (an add reads two buffers of S and writes one: 3S)."""
    if n <= 1:
        return 0.0
    return one_device_cost(n, nbytes, link) + (n - 1) * _time(add, 3 * nbytes)
