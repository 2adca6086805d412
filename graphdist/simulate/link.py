"""The link model of gd.simulate: one point-to-point link (latency + bytes / bandwidth) and
the `--link` parser."""

from __future__ import annotations

import re
from dataclasses import dataclass

@dataclass(frozen=True)
class Link:
    """One point-to-point link: a message of S bytes takes latency + S / bandwidth seconds."""

    latency: float        # seconds
    bandwidth: float      # bytes per second

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


DEFAULT_LINK = Link(5e-6, 25e9)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}    # exact: 5us == 5e-6
_RATE_UNITS = {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
               "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
               "Kb/s": 125.0, "Mb/s": 125e3, "Gb/s": 125e6, "Tb/s": 125e9}   # bits


def _quantity(key: str, text: str, units: dict) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*", text)
    if m is None or m.group(2) not in units:
        raise ValueError(f"--link: {key}={text!r}: expected a number and one of the units "
                         f"{', '.join(units)} (e.g. latency=5us,bandwidth=25GB/s)")
    if units is _TIME_UNITS:
        return float(m.group(1)) / _PER_SECOND[m.group(2)]
    return float(m.group(1)) * units[m.group(2)]


def parse_link(text: str) -> Link:
    """'latency=5us,bandwidth=25GB/s' as a Link (either key may be left out: the default's).

    >>> parse_link("latency=2us,bandwidth=100Gb/s")
    Link(latency=2e-06, bandwidth=12500000000.0)
    """
    values = {"latency": DEFAULT_LINK.latency, "bandwidth": DEFAULT_LINK.bandwidth}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in values:
            raise ValueError(f"--link: {part!r}: expected latency=TIME or bandwidth=RATE, "
                             "comma-separated (e.g. latency=5us,bandwidth=25GB/s)")
        values[key] = _quantity(key, value, _TIME_UNITS if key == "latency" else _RATE_UNITS)
    if values["bandwidth"] <= 0:
        raise ValueError(f"--link: bandwidth must be positive, got {text!r}")
    return Link(values["latency"], values["bandwidth"])


# the link between workers when MPI cannot be measured here (no mpi4py or mpiexec):
# shared memory between processes of one host, roughly
DEFAULT_MPI_LINK = Link(5e-6, 5e9)
