"""Launching distributed work: the SparkSession from config and the TorchDistributor runner."""
