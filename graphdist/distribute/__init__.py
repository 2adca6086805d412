"""Strategies, contexts, per-replica values and device handling."""
