"""The read path: exact offset-range reading (reader), per-rank batches (loader, batching) and a rank's loaders of
every split (split_loaders)."""
