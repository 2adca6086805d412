"""Fixtures every test module shares."""

from __future__ import annotations

import os

import pytest

import graphdist as gd

# Tests run each program on its kernels from the first call (the numpy forms a first call
# may run while kernels load are compared with them in test_warmup.py): a test of a few
# steps would otherwise never reach the kernels it means to test.
# (GRAPHDIST_TEST_BACKGROUND_COMPILE=1 runs the suite with it on, as users get it.)
gd.config.set_background_compile(os.environ.get("GRAPHDIST_TEST_BACKGROUND_COMPILE") == "1")


@pytest.fixture(autouse=True)
def _short_collective_timeout():
    """A replica waiting for a value nobody sends fails its test in seconds, not a minute."""
    old = gd.config.collective_timeout()
    gd.config.set_collective_timeout(5.0)
    yield
    gd.config.set_collective_timeout(old)


@pytest.fixture
def inline_collectives():
    """Collectives run inline (gd.config.set_overlap(False)), for tests of what runs there:
    the fused all-reduce + update and the inline collective kernels
    (tests/runtime/test_overlap.py covers overlap)."""
    gd.config.set_overlap(False)
    yield
    gd.config.set_overlap(True)


@pytest.fixture
def one_program():
    """The replicas on logical CPU devices as one program, device after device
    (set_device_concurrency("sequential")), for tests of the fusions that read every
    replica's buffers in one node (fuse_reduce_update, fuse_sharded_update); the default
    gives each device a thread of its own where the step's nodes are large."""
    gd.config.set_device_concurrency("sequential")
    yield
    gd.config.set_device_concurrency("auto")


@pytest.fixture
def device_threads():
    """The replicas on logical CPU devices on worker threads (set_device_concurrency(
    "threads")) whatever their nodes' sizes: "auto" runs a test's small model as one
    program."""
    gd.config.set_device_concurrency("threads")
    yield
    gd.config.set_device_concurrency("auto")
