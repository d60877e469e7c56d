"""Flow `produce` on the real broker: success and caching, a transient fault retried, permanent faults not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import flows.produce
from flows.produce import produce
from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import load_config
from kbit_core.kafka import admin
from tasks.config import profile_path
from tasks.policy import is_transient
from tasks.produce import ensure_dataset_topics
from tests.conftest import free_port
from tests.flows.helpers import delete_topics, flow_overrides, task_runs

pytestmark = pytest.mark.kafka


@pytest.fixture(autouse=True)
def no_retry_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    no_delay = ensure_dataset_topics.with_options(retry_delay_seconds=0)
    monkeypatch.setattr(flows.produce, "ensure_dataset_topics", no_delay)


@pytest.fixture(autouse=True)
def own_topics(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[None]:
    yield
    delete_topics(broker, tmp_path)


def test_produce_creates_the_matrix_topics_then_serves_them_from_cache(broker: EmbeddedBroker, tmp_path: Path) -> None:
    overrides = flow_overrides(
        broker,
        tmp_path,
        {
            "bench": {
                "variants": [
                    {"format": "avro", "layout": "list", "compression": "lz4"},
                    {"format": "raw", "layout": "bytes", "compression": "none"},
                ]
            }
        },
    )

    first = produce(profile="smoke", overrides=overrides, return_state=True)

    assert first.is_completed()
    topics = first.result()
    assert [t["variant"] for t in topics] == ["avro_list_lz4", "raw_bytes_none"]
    for t in topics:
        assert t["num_records"] == 240
        assert admin.topic_exists(load_config(profile_path("smoke"), overrides).kafka, t["topic"])

    second = produce(profile="smoke", overrides=overrides, return_state=True)
    assert second.result() == topics
    assert task_runs(second)["ensure-topics"].state.name == "Cached"


def test_a_broker_that_comes_up_between_attempts_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    late = EmbeddedBroker(tmp_path / "late-broker", port=free_port())
    attempts: list[bool] = []

    def start_broker_then_classify(task, task_run, state) -> bool:  # noqa: ANN001 (Prefect's hook signature)
        transient = is_transient(task, task_run, state)
        attempts.append(transient)
        late.start()
        return transient

    monkeypatch.setattr(
        flows.produce,
        "ensure_dataset_topics",
        ensure_dataset_topics.with_options(retry_delay_seconds=0, retry_condition_fn=start_broker_then_classify),
    )
    try:
        state = produce(profile="smoke", overrides=flow_overrides(late, tmp_path), return_state=True)
    finally:
        late.stop()

    assert state.is_completed(), state.message
    assert attempts == [True]  # the first attempt failed with a BrokerError, the second succeeded
    assert task_runs(state)["ensure-topics"].run_count == 2


def test_bad_config_fails_the_flow_at_once(broker: EmbeddedBroker, tmp_path: Path) -> None:
    state = produce(
        profile="smoke", overrides=flow_overrides(broker, tmp_path, {"train": {"epochs": 0}}), return_state=True
    )

    assert state.is_failed()
    assert "train.epochs" in state.message
    runs = task_runs(state)
    assert runs["load-config"].run_count == 1 and "ensure-topics" not in runs


def test_unknown_profile_names_the_known_ones(broker: EmbeddedBroker, tmp_path: Path) -> None:
    state = produce(profile="no-such-profile", overrides=flow_overrides(broker, tmp_path), return_state=True)

    assert state.is_failed()
    assert "no-such-profile" in state.message and "smoke" in state.message


def test_a_topic_with_unknown_contents_fails_without_retries(broker: EmbeddedBroker, tmp_path: Path) -> None:
    overrides = flow_overrides(broker, tmp_path)
    cfg = load_config(profile_path("smoke"), overrides)
    topic = cfg.produce.topic_for(cfg.dataset, cfg.bench.variants[0])
    admin.create_topic(cfg.kafka, topic, cfg.produce.partitions)  # a topic with no manifest: contents unknown
    state = produce(profile="smoke", overrides=overrides, return_state=True)

    assert state.is_failed()
    assert "kbit did not create it" in state.message
    assert task_runs(state)["ensure-topics"].run_count == 1
