"""ConsumerPerformance's summary as kafka_tools reads it, the targets built from it, the data-plane report's run line."""

from __future__ import annotations

import pytest

from kbit_core.bench.dataplane import data_plane_report, kafka_tools
from kbit_core.errors import KbitError

# ConsumerPerformance's (Kafka 4.4.0) summary, as it printed it on a 200,000-record topic
SUMMARY = """start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, rebalance.time.ms, \
fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec
2026-11-27 17:29:29:160, 2026-11-27 17:29:30:558, 154.1138, 110.2387, 200000, 143061.5165, 357, 1041, 148.0440, \
192122.9587
"""


def test_the_tools_own_fetch_rate_and_time_are_read_not_its_wall_time():
    read = kafka_tools.parse_consumer_performance(SUMMARY)
    assert read.records_per_s == pytest.approx(192122.9587)  # fetch.nMsg.sec, not nMsg.sec (which has the rebalance)
    assert read.mb_per_s == pytest.approx(148.0440 * 2**20 / 1e6)  # its MB are MiB
    assert read.fetch_seconds == pytest.approx(1.041)
    with pytest.raises(KbitError, match="no ConsumerPerformance summary"):
        kafka_tools.parse_consumer_performance("start.time, end.time\n")


def _consumer(seconds: float, ratio: float) -> dict:
    return {
        "client": "confluent",
        "tool_fetch_seconds": seconds,
        "like_for_like": seconds >= kafka_tools.MIN_TOOL_FETCH_S,
        "fetch_over_tool": ratio,
        "read_decode_over_tool": ratio * 0.9,
    }


def test_targets_name_a_tool_run_too_short_to_compare():
    long_run, short_run = _consumer(1.5, 0.95), _consumer(0.4, 3.0)
    (fetch, decode), (short_fetch, _) = (
        kafka_tools.consumer_targets("raw_bytes_none", "bytes", [c]) for c in (long_run, short_run)
    )
    assert fetch["met"] and decode["met"] and "tool fetched" not in fetch["target"]
    assert "tool fetched 0.40 s" in short_fetch["target"] and "favours kbit" in short_fetch["target"]
    # a list layout has no read+decode target against the tool
    assert len(kafka_tools.consumer_targets("avro_list_none", "list", [long_run])) == 1


def test_the_reports_run_line_names_broker_client_and_load():
    meta = {
        "created_at": "2026-11-27T17:42:06.07+00:00",
        "broker": "Kafka cluster at 127.0.0.1:29777",
        "cpus": 2,
        "clients": {"confluent-kafka": "2.16.1", "librdkafka": "2.16.0"},
        "load_average_1m_at_start": 15.96,
        "load_average_1m_at_end": 14.6,
    }
    line = data_plane_report.run_line(meta)
    assert line.startswith("2026-11-27 17:42 UTC; Kafka cluster at 127.0.0.1:29777; confluent-kafka 2.16.1")
    assert "load average 15.96 at the start, 14.6 at the end" in line
    # results written before the run recorded its load say so instead of failing
    del meta["load_average_1m_at_start"], meta["clients"]
    assert "load unrecorded" in data_plane_report.run_line(meta)
