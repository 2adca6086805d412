"""graphdist benchmarks: `python -m bench` runs them all; each prints a table and saves JSON.

graphdist is imported first, before numpy loads OpenBLAS, so its thread and kernel
defaults apply as they do for a user who imports graphdist first (graphdist/device/threads.py);
peers run in their own processes without them."""

import graphdist  # noqa: F401
