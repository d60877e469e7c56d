"""Benchmarks: statistics, the iteration runner, worker-side measurement, reports and run comparison."""
