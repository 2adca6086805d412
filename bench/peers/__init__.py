"""Peer implementations of the benchmark models (run in the benchmark's own environment)."""
