"""Benchmarks for batchgate: load generator, sweeps, offline baselines and side-by-side comparisons.

Not part of the installed package and not run by CI; see docs/BENCHMARKS.md.
"""
