"""The delivery ledger's diagnosis asks whether an in-sync replica's broker takes a TCP connection at all (a cluster
that lost its quorum still lists dead brokers in its in-sync sets): a listening port answers, a closed one is named."""

from __future__ import annotations

import socket

from confluent_kafka.admin import BrokerMetadata

from kbit_core.kafka import replicas


def _broker(port: int) -> BrokerMetadata:
    broker = BrokerMetadata()
    broker.id, broker.host, broker.port = 2, "127.0.0.1", port
    return broker


def test_a_broker_that_takes_a_connection_answers_and_a_closed_port_is_named():
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert replicas._unanswered(_broker(port)) is None
    closed = port  # nothing listens there now
    assert replicas._unanswered(_broker(closed)) == f"at 127.0.0.1:{closed} does not answer (Connection refused)"
    assert replicas._unanswered(None) == "is not in the cluster's metadata"
