"""Statistics of benchmark runs, pure numbers in and numbers out: sample statistics and significance tests, run
comparison, nightly history, a run's identity, the network crossover and metric names. Imports nothing of kbit's
I/O."""
