"""How runs are benchmarked, tracked and swept, and where the local stack serves."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from kbit_core.config.base import ClientName, Section
from kbit_core.config.data import DatasetConfig, DataVariant

# The network profile of a bed whose links are not shaped (one of bench.networks).
LOOPBACK = "loopback"


class BenchConfig(Section):
    iterations: int = Field(30, ge=1)
    warmup_iterations: int = Field(1, ge=0)
    variants: list[DataVariant] = Field(default_factory=lambda: default_bench_variants())
    records_per_message: list[int] | None = Field(
        None,
        description="Records per Kafka message to measure every variant at (e.g. [1, 8, 64]), a matrix dimension "
        "crossed with bench.variants; unset = each variant's own records_per_message.",
    )
    datasets: list[DatasetConfig] | None = Field(
        None,
        description="kbit bench-data: the payloads to measure every variant on, e.g. synthetic_digits and "
        "synthetic_tokens; unset = dataset only. A variant a payload cannot travel in (token ids in a list "
        "layout, or in avro/json/bson bytes) is left out with its reason.",
    )
    clients: list[ClientName] = Field(default_factory=lambda: ["confluent"])
    batch_sizes: list[int] | None = None
    world_sizes: list[int] | None = None
    train_epoch: bool = Field(False, description="Also time one training epoch per configuration.")
    shuffle_order: bool = True
    seed: int = 0
    output_dir: Path = Path(".kbit/reports")
    regression_threshold: float = Field(0.10, gt=0, description="Relative median slowdown flagged as regression.")
    bootstrap_resamples: int = Field(2000, ge=100)
    decoders: list[Literal["fast", "stock"]] | None = Field(
        None,
        description="Decoders to measure (kbit's fast path and each format's stock library), a matrix "
        "dimension; unset = reader.decoder only.",
    )
    engines: list[Literal["spark", "ray", "torchrun"]] | None = Field(
        None, description="Launchers to measure under, a matrix dimension; unset = launch.engine only."
    )
    networks: list[str] | None = Field(
        None,
        description="Network profiles to measure on, a matrix dimension run on the test bed (its links re-shaped "
        "between networks): 'loopback' (unshaped) or RATE[-DELAY[-LOSS]], e.g. 10gbit-0.2ms, 1gbit-0.5ms, "
        "100mbit-2ms; unset = the links as they are.",
    )

    @field_validator("records_per_message")
    @classmethod
    def _positive_counts(cls, counts: list[int] | None) -> list[int] | None:
        if counts is not None and (not counts or min(counts) < 1):
            raise ValueError(f"bench.records_per_message must list counts >= 1, got {counts}")
        return counts

    def matrix_variants(self) -> list[DataVariant]:
        """bench.variants, each at every bench.records_per_message (when set), in that order, without repeats."""
        if not self.records_per_message:
            return list(self.variants)
        crossed = (
            v.model_copy(update={"records_per_message": n}) for v in self.variants for n in self.records_per_message
        )
        return list({v.name: v for v in crossed}.values())


def default_bench_variants() -> list[DataVariant]:
    """The original's four (avro/json × lz4/none, list layout) plus protobuf, bson and raw in both layouts."""
    out: list[DataVariant] = []
    for fmt in ("avro", "json", "protobuf", "bson", "raw"):
        for layout in ("list", "bytes"):
            if fmt == "raw" and layout == "list":
                continue
            for comp in ("lz4", "none"):
                out.append(DataVariant(format=fmt, layout=layout, compression=comp))
    return out


class TrackingConfig(Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="MLflow URI; unset means sqlite:///<workdir>/mlflow.db.")
    experiment: str | None = Field(None, description="Experiment name; unset means 'kbit-<profile>'.")
    log_models: bool = True
    system_metrics: bool = True
    run_tags: dict[str, str] = Field(
        default_factory=dict,
        description="Tags on every run this config starts: the Prefect tasks put the flow run's id and page here.",
    )


class SweepConfig(Section):
    backend: Literal["prefect", "ray-tune"] = Field(
        "prefect",
        description="Trials as Prefect tasks in turn, or as "
        "Ray Tune trials with ASHA early stopping (the `ray` extra).",
    )
    grace_epochs: int = Field(1, ge=1, description="ASHA: epochs every trial runs before it may be stopped.")
    reduction_factor: int = Field(2, ge=2, description="ASHA: 1/reduction_factor of trials go on at each rung.")


class StackConfig(Section):
    prefect_port: int = 4200
    mlflow_port: int = 5000
    work_pool: str = "kbit-process"
    host: str = "127.0.0.1"
    prefect_api_url: str | None = Field(None, description="Remote Prefect API; unset means the local server.")
    database: Literal["sqlite", "postgresql"] = Field(
        "sqlite",
        description="Where the local Prefect and MLflow servers keep their data: SQLite files in the workdir, or "
        "kbit's own PostgreSQL server (data in <workdir>/state/postgres, users and passwords of its own).",
    )
    postgres_port: int = 5432
    artifacts: Literal["local", "s3"] = Field(
        "local",
        description="Where the local MLflow server puts artifacts: <workdir>/mlartifacts, or s3proxy's "
        "S3-compatible bucket (filesystem backend in <workdir>/state/s3proxy), served through MLflow.",
    )
    s3_port: int = 8333
    auth: bool = Field(
        False,
        description="Put the local MLflow server (its basic-auth app) and Prefect server (an auth string) behind "
        "a login kbit generates (<workdir>/state/credentials, mode 0600); kbit's own clients log in.",
    )
