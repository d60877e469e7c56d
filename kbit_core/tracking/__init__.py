"""Experiment tracking in MLflow: the environment, the config as params, the trackers and the store's queries.

A benchmark is one parent run (params = the flattened, masked config; tags = git commit, versions, hardware,
broker) with one nested child run per configuration carrying every statistic as a metric under names that never
change between runs (:mod:`kbit_core.stats.metrics`). A training run gets per-epoch metrics, system metrics and
the model. This package is the only one that imports mlflow.
"""

from kbit_core.tracking.environment import package_versions, run_environment
from kbit_core.tracking.params import benchmark_settings, config_params
from kbit_core.tracking.queries import benchmark_nights, log_history, previous_benchmark, record_overrides, run_url
from kbit_core.tracking.trackers import (
    BENCHMARK_ARTIFACT_DIR,
    MlflowTracker,
    NoopTracker,
    Tracker,
    final_metrics,
    make_tracker,
    training_history,
)

__all__ = [
    "BENCHMARK_ARTIFACT_DIR",
    "MlflowTracker",
    "NoopTracker",
    "Tracker",
    "benchmark_nights",
    "benchmark_settings",
    "config_params",
    "final_metrics",
    "log_history",
    "make_tracker",
    "package_versions",
    "previous_benchmark",
    "record_overrides",
    "run_environment",
    "run_url",
    "training_history",
]
