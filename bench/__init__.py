"""Benchmarks: what governance costs, measured against a bare Temporal agent loop.

Scripts, not tests: ``python -m bench.overhead`` and ``python -m bench.waiting`` (see
docs/performance.md).
"""
