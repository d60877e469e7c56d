"""Why a broker did not start, read from its server log: the warnings and the first error, not the shutdown after."""

from __future__ import annotations

from pathlib import Path

from kbit_core.brokers.apache_broker import ApacheKafkaBroker

# Abridged from a bed broker that failed to register (its two peers never started): the retried connection warns
# every half second, then the cause is logged, then the shutdown's INFO lines (hundreds in the real log).
LOG = """\
[2026-11-27 17:30:25,001] INFO Registered `kafka:type=kafka.Log4jController` MBean (org.apache.kafka.server)
[2026-11-27 17:30:30,848] WARN [RaftManager id=1] Connection to node 2 (/10.213.7.11:19095) terminated during authentication. (org.apache.kafka.clients.NetworkClient)
[2026-11-27 17:30:31,848] WARN [RaftManager id=1] Connection to node 2 (/10.213.7.11:19095) terminated during authentication. (org.apache.kafka.clients.NetworkClient)
[2026-11-27 17:31:33,897] ERROR [BrokerLifecycleManager id=1] Shutting down because we were unable to register with the controller quorum. (org.apache.kafka.server.BrokerLifecycleManager)
[2026-11-27 17:31:33,898] ERROR [BrokerServer id=1] Received a fatal error while waiting for the controller to acknowledge that we are caught up (kafka.server.BrokerServer)
[2026-11-27 17:31:34,137] ERROR Exiting Kafka due to fatal exception during startup. (kafka.Kafka$)
java.lang.RuntimeException: Received a fatal error while waiting for the controller to acknowledge that we are caught up
\tat kafka.server.BrokerServer.startup(BrokerServer.scala:1)
[2026-11-27 17:31:39,300] INFO [SharedServer id=1] Stopping SharedServer (kafka.server.SharedServer)
"""  # noqa: E501


def _broker(tmp_path: Path, log: str) -> ApacheKafkaBroker:
    broker = ApacheKafkaBroker(tmp_path, name="kafka-driver")
    broker.server_log_path.parent.mkdir(parents=True)
    broker.server_log_path.write_text(log)
    return broker


def test_the_cause_is_the_distinct_warnings_and_the_first_error(tmp_path: Path):
    broker = _broker(tmp_path, LOG)
    assert broker.fatal_error() == (
        "java.lang.RuntimeException: Received a fatal error while waiting for the controller to acknowledge that we "
        "are caught up"
    )
    assert broker.why().splitlines()[1:] == [
        "WARN [RaftManager id=1] Connection to node 2 (/10.213.7.11:19095) terminated during authentication. "
        "(org.apache.kafka.clients.NetworkClient)",
        "ERROR [BrokerLifecycleManager id=1] Shutting down because we were unable to register with the controller "
        "quorum. (org.apache.kafka.server.BrokerLifecycleManager)",
    ]


def test_a_log_without_warnings_gives_its_tail(tmp_path: Path):
    broker = _broker(tmp_path, "[2026-11-27 17:30:25,001] INFO starting (kafka.Kafka$)\n")
    assert broker.why().splitlines()[1:] == ["[2026-11-27 17:30:25,001] INFO starting (kafka.Kafka$)"]
