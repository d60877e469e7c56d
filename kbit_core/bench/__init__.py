"""Benchmarks, one room each: the loading benchmark (rank-side timing and its reports), the data-plane benchmark
with its peer readers, and the training benchmarks. Their statistics live in :mod:`kbit_core.stats`."""
