"""Flow `nightly`: the benchmark on the nightly profile, gated on the previous nightly run."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.benchmark import benchmark


@flow(name="nightly", log_prints=True)
def nightly(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The nightly benchmark as a flow of its own (the `benchmark/nightly` deployment runs the same steps).

    Steps:
      1. Run the `benchmark` flow with the `nightly` profile and ``overrides``.
      2. Compare it with the previous finished nightly run in MLflow; a significant regression fails
         this flow loudly, naming every configuration that got slower.
    """
    return benchmark(profile="nightly", overrides=overrides, compare_with_previous=True)


if __name__ == "__main__":
    nightly()
