"""Fixtures every test module shares."""

from __future__ import annotations

import pytest

import graphdist as gd


@pytest.fixture(autouse=True)
def _short_collective_timeout():
    """A replica waiting for a value nobody sends fails its test in seconds, not a minute."""
    old = gd.config.collective_timeout()
    gd.config.set_collective_timeout(5.0)
    yield
    gd.config.set_collective_timeout(old)
