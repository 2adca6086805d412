"""graphdist benchmarks: `python -m bench` runs them all; each prints a table and saves JSON."""
