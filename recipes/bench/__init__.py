"""Micro-benchmarks of single components."""
