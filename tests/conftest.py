"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

import graphdist as gd


@pytest.fixture
def per_device():
    """Steps over logical CPU devices run as per-device copies (not merged), for tests of
    what the replication pass and the cross-device ops make of each device."""
    gd.config.set_device_concurrency("sequential")
    yield
    gd.config.set_device_concurrency("auto")
