"""Experiment tracking in MLflow: the environment, the config as params, the trackers and the store's queries.

A benchmark is one parent run (params = the flattened, masked config; tags = git commit, versions, hardware,
broker) with one nested child run per configuration carrying every statistic as a metric under names that never
change between runs (:mod:`kbit_core.stats.metrics`). A training run gets its curves, measures and facts laid out
for MLflow's UI (:mod:`kbit_core.tracking.training`), system metrics, and its model registered
(:mod:`kbit_core.tracking.registry`). This package is the only one that imports mlflow.
"""

from kbit_core.tracking.environment import package_versions, run_environment
from kbit_core.tracking.params import benchmark_settings, config_params
from kbit_core.tracking.queries import benchmark_nights, log_history, previous_benchmark, record_overrides, run_url
from kbit_core.tracking.registry import registered_model_name
from kbit_core.tracking.trackers import BENCHMARK_ARTIFACT_DIR, MlflowTracker, NoopTracker, Tracker, make_tracker
from kbit_core.tracking.training import final_metrics, metric_series, training_history, training_run_name

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
    "metric_series",
    "package_versions",
    "previous_benchmark",
    "record_overrides",
    "registered_model_name",
    "run_environment",
    "run_url",
    "training_history",
    "training_run_name",
]
