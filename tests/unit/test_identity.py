"""Run identities: what two benchmark runs must share to be compared, and `kbit compare` refusing the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kbit_core.bench.loading.report import analyze, timings_frame
from kbit_core.cli import app
from kbit_core.config import KbitConfig
from kbit_core.errors import StatisticsError
from kbit_core.stats.identity import (
    check_comparable,
    identity_differences,
    identity_hash,
    measurement_overrides,
    run_identity,
)
from tests.unit.test_compare import NIGHTLY
from tests.unit.test_report import synthetic_rows

HARDWARE = {
    "host": "vm-1",
    "machine": "x86_64",
    "cpu_model": "EPYC",
    "cpu_count": 2,
    "memory_gb": 23.5,
    "load_average_1m": 3.2,
}
BROKER = {"kind": "embedded", "version": "tansu 0.6.0"}


def identity(changes: dict | None = None, hardware: dict | None = None) -> dict:
    cfg = KbitConfig.from_dict(
        {"profile": "nightly", "dataset": {"num_records": 70000}, "bench": {"iterations": 10}}
    ).override(changes or {})
    return run_identity(cfg, {**HARDWARE, **(hardware or {})}, BROKER)


def test_identity_holds_what_the_numbers_depend_on_and_not_where_they_ran() -> None:
    ident = identity()
    assert ident["dataset"] == {"source": KbitConfig().dataset.name, "num_records": 70000, "seed": 0}
    assert len(ident["variants"]) == 18 and ident["clients"] == ["confluent"] and ident["iterations"] == 10
    assert ident["engine"] == "none (loading only)" and ident["broker"] == BROKER
    # The host's name and its load at start are no part of the fingerprint: an identical VM compares.
    assert identity(hardware={"host": "vm-2", "load_average_1m": 0.1}) == ident
    assert identity_hash(identity()) == identity_hash(ident)
    assert identity({"bench.train_epoch": True, "deepspeed.enabled": True})["engine"] == "deepspeed"


def test_differences_are_named_field_by_field() -> None:
    a, b = identity(), identity({"dataset.num_records": 20000, "bench.iterations": 5}, hardware={"cpu_count": 16})
    assert identity_differences(a, b) == [
        "dataset.num_records: 70000 vs 20000",
        "hardware.cpu_count: 2 vs 16",
        "iterations: 10 vs 5",
    ]
    assert identity_hash(a) != identity_hash(b)


def test_only_overrides_that_change_the_measurement_count() -> None:
    overrides = {
        "workdir": "/tmp/x",
        "tracking": {"tracking_uri": "sqlite:///x.db"},
        "kafka": {"embedded": {"port": 1}},
        "produce": {"topic_prefix": "t", "partitions": 4},
        "bench": {"output_dir": "r", "iterations": 5},
    }
    assert measurement_overrides(overrides) == {"produce.partitions": "4", "bench.iterations": "5"}
    assert measurement_overrides(None) == {}


def stats(seed: int, **changes: object) -> dict:
    doc = analyze(
        timings_frame(synthetic_rows(iterations=6, warmup=0, seed=seed, configs=NIGHTLY)),
        bootstrap_resamples=100,
        seed=0,
    )
    doc["metadata"] = {"identity": identity(dict(changes))}
    return doc


def test_incomparable_runs_are_refused_naming_the_differences() -> None:
    check_comparable(stats(1), stats(2))
    with pytest.raises(StatisticsError, match=r"not comparable: .*iterations: 10 vs 30"):
        check_comparable(stats(1), stats(2, **{"bench.iterations": 30}))
    with pytest.raises(StatisticsError, match="run A records no identity"):
        check_comparable({"metadata": {}}, stats(2))


def test_kbit_compare_refuses_an_incomparable_baseline_unless_forced(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(stats(1, **{"dataset.num_records": 20000})))
    b.write_text(json.dumps(stats(2)))
    runner = CliRunner()
    refused = runner.invoke(app, ["compare", str(a), str(b)])
    assert refused.exit_code == 1
    assert "not comparable" in refused.output and "dataset.num_records: 20000 vs 70000" in refused.output
    forced = runner.invoke(app, ["compare", str(a), str(b), "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    assert "compared anyway (--force): dataset.num_records" in forced.output
