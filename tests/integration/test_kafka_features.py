"""Kafka's kafka-features tool as the bed's rolling upgrade runs it (kbit_core.testbed.upgrade.FeatureTool), against
the session's Apache Kafka broker: what it reads back is what the broker's release finalizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kbit_core.brokers.kafka_release import installed_kafka_versions, kafka_version
from kbit_core.testbed.upgrade import METADATA_VERSION, FeatureTool, release_of

pytestmark = pytest.mark.kafka


def test_a_broker_kbit_formats_is_at_its_releases_latest_metadata_version(apache_kafka, tmp_path: Path):
    plaintext = tmp_path / "features.properties"
    plaintext.write_text("")
    tool = FeatureTool(apache_kafka.bootstrap, plaintext, kafka_version())
    wanted = tool.release_levels()
    assert wanted[METADATA_VERSION].startswith(release_of(kafka_version()) + "-IV"), wanted
    assert tool.finalized()[METADATA_VERSION] == wanted[METADATA_VERSION]
    # the previous release maps to its own, older level: the rolling upgrade's starting point
    for older in installed_kafka_versions():
        mapped = FeatureTool(apache_kafka.bootstrap, plaintext, older).release_levels()[METADATA_VERSION]
        assert mapped.startswith(release_of(older) + "-IV") and mapped != wanted[METADATA_VERSION]
