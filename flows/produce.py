"""Flow `produce`: make sure the topics of the benchmark matrix exist."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.config import load_run_config
from tasks.produce import ensure_dataset_topics


@flow(name="produce", log_prints=True)
def produce(profile: str = "smoke", overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Ensure one topic per variant of the profile's benchmark matrix.

    Steps:
      1. Load and validate the profile with the overrides (bad config fails here, without retries).
      2. Ensure the topics of every ``bench.variants`` entry (at each ``bench.records_per_message``), reusing topics whose manifest matches.
    """
    cfg = load_run_config(profile, overrides)
    return ensure_dataset_topics(cfg, cfg.bench.matrix_variants())


if __name__ == "__main__":
    produce(profile="smoke")
