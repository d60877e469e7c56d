"""Continuous-training settings: what the config model and the driver refuse, and what a stream lineage keys on."""

from __future__ import annotations

import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.jobs.continuous import check_continuous
from kbit_core.train.checkpoint import lineage_settings

CONTINUOUS = {"train": {"mode": "continuous"}, "stream": {"topic": "events"}}


def test_a_stream_lineage_ignores_the_world_size_but_not_the_topic() -> None:
    cfg = KbitConfig.from_dict(CONTINUOUS)
    assert lineage_settings(cfg) == lineage_settings(cfg.override({"launch.num_processes": 1}))
    assert lineage_settings(cfg) != lineage_settings(cfg.override({"stream.topic": "other-events"}))
    # A batch DDP or ZeRO lineage re-plans an interrupted epoch for another world size; a pipeline keeps its own.
    for batch in (KbitConfig(), KbitConfig.from_dict({"deepspeed": {"enabled": True}})):
        assert lineage_settings(batch) == lineage_settings(batch.override({"launch.num_processes": 1}))
    pipeline = KbitConfig.from_dict({"deepspeed": {"enabled": True}, "train": {"pipeline": {"stages": 2}}})
    assert lineage_settings(pipeline) != lineage_settings(pipeline.override({"launch.num_processes": 4}))


@pytest.mark.parametrize(
    "stream,message",
    [
        ({"start": "timestamp"}, "stream.start=timestamp needs stream.start_timestamp_ms"),
        ({"start": "offsets"}, "stream.start=offsets needs stream.start_offsets"),
        ({"rate": 0}, "stream.rate"),
    ],
)
def test_bad_stream_settings_name_the_field(stream: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KbitConfig.from_dict({"stream": stream})


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"train.grad_accum_steps": 2}, "train.grad_accum_steps=1"),
        ({"produce.variant.records_per_message": 4}, "records_per_message=1"),
        ({"train.data": "memory"}, "train.data must be 'kafka'"),
        ({"produce.partitions": 1}, "launch.num_processes=2"),
        ({"kafka.client": "kafka-python"}, "kafka.client=confluent"),
    ],
)
def test_the_driver_refuses_what_continuous_training_cannot_do(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_continuous(KbitConfig.from_dict(CONTINUOUS).override(changes))
