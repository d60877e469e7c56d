"""The training benchmarks: streamed against in-memory training, launcher placement, direct reads, the fast
consumer, activation memory."""
