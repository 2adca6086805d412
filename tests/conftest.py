"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

import graphdist as gd
