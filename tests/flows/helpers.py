"""What the flow tests share: overrides pointing a profile at the test broker, and task-run lookups."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KafkaConfig, deep_merge
from kbit_core.kafka import admin
from tests.conftest import embedded_settings, new_mlflow_store


def flow_overrides(broker: EmbeddedBroker, tmp_path: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Overrides that keep a run on ``broker``, in ``tmp_path``, on a tiny dataset, with topics of its own
    (prefixed with the temporary directory's name; see :func:`delete_topics`)."""
    base = {
        "workdir": str(tmp_path / "kbit"),
        "produce": {"topic_prefix": topic_prefix(tmp_path)},
        "kafka": {"embedded": embedded_settings(broker)},
        "tracking": {"tracking_uri": new_mlflow_store(tmp_path / "mlflow.db")},
        "dataset": {"num_records": 240},
        "bench": {"variants": [{"format": "avro", "layout": "list", "compression": "lz4"}]},
    }
    return deep_merge(base, extra or {})


def task_runs(flow_state: State[Any]) -> dict[str, TaskRun]:
    """The flow run's task runs by task name (the last run of each name)."""
    flow_run_id: UUID = flow_state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run for run in sorted(runs, key=lambda r: r.expected_start_time)}


def topic_prefix(tmp_path: Path) -> str:
    return "test-" + "".join(c for c in tmp_path.name if c.isalnum())


def delete_topics(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """Delete the topics a test produced through :func:`flow_overrides` (the session broker is shared)."""
    kafka = KafkaConfig(embedded={"port": broker.port})
    for topic in admin.list_topics(kafka):
        if topic.startswith(topic_prefix(tmp_path) + "."):
            admin.delete_topic(kafka, topic)
