"""Devices: names and discovery, the numpy and CuPy backends, thread control."""
