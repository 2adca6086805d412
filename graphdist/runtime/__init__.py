"""Backends, lowering to generated programs, and executables."""
