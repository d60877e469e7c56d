"""The read side of the data plane: exact offset-range reading (reader) and per-rank batches (loader)."""
