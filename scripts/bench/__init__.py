"""Benchmarks and the GPU smoke test (BENCHMARKS.md has their figures)."""
