"""Benchmarks: each prints a table and then one JSON line."""
