"""Environment flags, read once here and nowhere else (GRAPHDIST_*)."""

from __future__ import annotations

import os

DEBUG = int(os.environ.get("GRAPHDIST_DEBUG", "0") or 0)
CHECK = os.environ.get("GRAPHDIST_CHECK", "0") not in ("", "0")
CALIBRATION = os.environ.get("GRAPHDIST_CALIBRATION", "")   # gd.simulate's calibration file
