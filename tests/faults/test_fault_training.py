"""Faults inside a real training run (Spark TorchDistributor, the real broker): a clear typed error naming where,
and nothing left running or on disk."""

from __future__ import annotations

import time

import pytest

from kbit_core.errors import DistributedError
from kbit_core.jobs.train import train
from kbit_core.kafka.broker import EmbeddedBroker
from tests.conftest import SMALL_TRAINING, free_port, processes_mentioning

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_broker_gone_mid_epoch_is_a_clear_error(
    spark, make_config, topic_name, tmp_path, fault_models_importable, launch_debris, record_property
):
    own = EmbeddedBroker(tmp_path / "own-broker", port=free_port())
    own.start()
    try:
        cfg = make_config(
            {**SMALL_TRAINING, "dataset": {"num_records": 8000}},
            produce__topic=topic_name,
            kafka__embedded__port=own.port,
            kafka__embedded__broker="tansu",
            reader__deadline_s=3.0,
            train__model={
                "name": "fault_models:stop_broker",
                "kwargs": {"at_step": 2, "broker_dir": str(own.run_dir), "port": own.port},
            },
        )
        started = time.monotonic()
        with pytest.raises(DistributedError) as info:
            train(cfg, progress=False)
        record_property("seconds", round(time.monotonic() - started, 2))
    finally:
        own.stop()
    message = str(info.value)
    record_property("error_type", "BrokerError" if "BrokerError" in message else "ReadTimeoutError")
    assert "ReadTimeoutError" in message or "BrokerError" in message, message
    # Whichever read notices first names where: the unreachable broker, or the topic/partition/offset it stalled on.
    assert own.bootstrap in message or f"topic={topic_name}" in message, message
    assert processes_mentioning(str(cfg.run_dir)) == [], "a rank of the failed run is still running"
    assert launch_debris(cfg.run_dir) == [] and list((cfg.run_dir / "spark").glob("run-*")) == []
