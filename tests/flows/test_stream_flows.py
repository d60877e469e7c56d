"""Flows `produce_stream` and `train_stream` on the real broker: what the live producer appended, and the
continuous training's lag/freshness artifact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from flows.stream import produce_stream, train_stream
from kbit_core.kafka.broker import EmbeddedBroker
from kbit_core.stream.manifest import StreamLog
from tests.flows.helpers import delete_topics, flow_overrides, topic_prefix

pytestmark = pytest.mark.kafka


@pytest.fixture(autouse=True)
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def stream_overrides(broker: EmbeddedBroker, tmp_path: Path, **stream: object) -> dict[str, object]:
    return flow_overrides(broker, tmp_path, {
        "stream": {"topic": f"{topic_prefix(tmp_path)}.stream", "rate": 2000, **stream},
        "train": {"model": {"name": "mlp"}, "global_batch_size": 32}, "checkpoint": {"dir": None},
        "tracking": {"enabled": False}})


def test_produce_stream_appends_and_a_second_run_continues(broker: EmbeddedBroker, tmp_path: Path) -> None:
    first = produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=40))
    second = produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=100))
    assert (first["produced"], second["produced"], second["next_index"]) == (40, 60, 100)
    assert StreamLog.load(Path(second["manifest_path"])).runs() == {0: [[0, 98]], 1: [[1, 99]]}


@pytest.mark.spark
@pytest.mark.slow
def test_train_stream_publishes_lag_and_freshness(broker: EmbeddedBroker, tmp_path: Path) -> None:
    produce_stream(profile="train-stream", overrides=stream_overrides(broker, tmp_path, records=320))
    summary = train_stream(profile="train-stream", overrides=stream_overrides(
        broker, tmp_path, stop_after_records=320, eval_records=100, eval_every_steps=5))
    assert summary["stop_reason"] == "records" and summary["lag_records"] == 0
    assert summary["freshness_s"]["p50"] > 0 and summary["metrics"]["records"] == 320
    with get_client(sync_client=True) as client:
        (artifact,) = [a for a in client.read_artifacts() if a.key == "kbit-stream-training"][-1:]
    assert "**320 records in" in artifact.data and "| step | records |" in artifact.data
