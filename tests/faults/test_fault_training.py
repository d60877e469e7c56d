"""Faults inside a real training run (Spark TorchDistributor, the real broker): a clear typed error naming where,
and nothing left running or on disk."""

from __future__ import annotations

import logging
import time

import pytest

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.errors import BrokerError, DistributedError
from kbit_core.jobs.train import train
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


def test_a_broker_kbit_started_that_died_costs_no_restart_and_is_named(
    spark, make_config, topic_name, tmp_path, fault_models_importable, caplog, record_property
):
    """Issue 21 defect 10: a restart was spent on the embedded broker kbit had started itself and that died, and the
    advice was `kbit stack up`, which the user never ran."""
    port = free_port()  # nothing listens: `train` starts the broker itself
    cfg = make_config(
        {**SMALL_TRAINING, "dataset": {"num_records": 8000}},
        produce__topic=topic_name,
        kafka__embedded={"port": port, "broker": "tansu"},
        reader__deadline_s=3.0,
        checkpoint__max_restarts=2,
        train__model={"name": "fault_models:stop_broker", "kwargs": {"at_step": 2, "broker_dir": "", "port": port}},
    )
    cfg = cfg.override({"train.model.kwargs.broker_dir": str(cfg.run_dir)})  # where train keeps its broker's files
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(BrokerError) as info:
        train(cfg, progress=False)
    record_property("seconds", round(time.monotonic() - started, 2))
    assert str(info.value).startswith("training failed on rank")
    assert f"the embedded tansu broker that this kbit command started on 127.0.0.1:{port} has died" in str(info.value)
    assert "kbit stack up" not in str(info.value) and "restart 1 of 2" not in caplog.text
    assert processes_mentioning(str(cfg.run_dir)) == [], "a rank of the failed run is still running"
