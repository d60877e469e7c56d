"""The driver side: one module per job a user starts (train, continuous training, benchmark, benchmark history,
live-stream benchmark, Ray Tune sweep) and the preflight checks they run first."""
