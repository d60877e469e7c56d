"""Benchmarks: statistics, rank-side measurement, reports, run comparison and history, and the data-plane and
training benchmarks."""
