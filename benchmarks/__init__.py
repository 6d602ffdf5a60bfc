"""Benchmarks: named specs (specs.py), the JAX and PyTorch sides, and the runner (run.py)."""
