"""Benchmarks (run with ``python -m bench.save_restore``)."""
