"""The reader's consumer for ``reader.fetch: batches``: Fetch requests of kbit's own, sent to each partition's leader
over a :class:`FetchConnection`, their record batches parsed into :class:`RecordColumns` with no Python object per
record."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import kafka.codec
import kafka.errors
from kafka.protocol.consumer import FetchRequest, FetchResponse
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from kbit_core.config import ClientName, KafkaConfig, ReaderConfig
from kbit_core.errors import BrokerError, CorruptRecordError, OffsetRangeError, TopicError
from kbit_core.kafka.consumers import FETCH_WAIT_MS, ConfluentConsumer, ConsumerBackend
from kbit_core.kafka.fetch_connection import FetchConnection
from kbit_core.kafka.record_batches import RecordBatchError, parse_batches
from kbit_core.kafka.record_columns import RecordColumns
from kbit_core.kafka.settings import kafka_python_options

log = logging.getLogger(__name__)

READ_COMMITTED = 1
# Fetch v4 brought read_committed; v12 is the last that names topics (v13 asks for topic ids).
MIN_FETCH_VERSION, MAX_FETCH_VERSION = 4, 12
MAX_METADATA_VERSION = 12
MIN_FETCH_BYTES = 64 * 1024
# Fetches in flight at most: the one being read and the next, which the broker answers while the first is parsed
# and handed over (a broker reads a connection's next request only after it has answered the one before).
FETCHES_IN_FLIGHT = 2
_DECOMPRESS = {
    1: kafka.codec.gzip_decode,
    2: kafka.codec.snappy_decode,
    3: kafka.codec.lz4_decode,
    4: kafka.codec.zstd_decode,
}
_OUT_OF_RANGE, _UNKNOWN_PARTITION = kafka.errors.OffsetOutOfRangeError, kafka.errors.UnknownTopicOrPartitionError


def decompress(codec: int, payload: bytes) -> bytes:
    if codec not in _DECOMPRESS:
        raise RecordBatchError(f"unknown compression codec {codec}")
    return _DECOMPRESS[codec](payload)


class BatchConsumer(ConsumerBackend):
    """Reads assigned partitions of one topic, one partition's fetch at a time; a response's records past
    ``max_records`` wait for the next poll. Leaders come from a Metadata request, asked again after any error that
    may mean leadership moved."""

    client: ClientName = "kafka-python"  # its protocol classes, TLS and SASL set-up, not its consumer
    bounds_opens_client = True

    def __init__(self, kafka_cfg: KafkaConfig, reader_cfg: ReaderConfig, metadata: bool = False) -> None:
        self.kafka_cfg, self.reader_cfg, self.metadata = kafka_cfg, reader_cfg, metadata
        self._options: dict[str, Any] | None = None
        self._connections: dict[int, FetchConnection] = {}  # node id -> connection
        self._brokers: dict[int, tuple[str, int]] = {}
        self._leaders: dict[int, int] = {}  # partition -> leader's node id, of ``topic``
        self._positions: dict[int, int] = {}  # partition -> next offset to deliver
        self._ready: dict[int, RecordColumns] = {}  # partition -> fetched records not yet delivered
        self._last_error: str | None = None
        self._record_bytes: float | None = None  # fetched bytes per record delivered, in the last response
        self._sent: deque[tuple[int, int, int, int]] = deque()  # Fetches sent ahead: partition, offset, node, id

    def open(self) -> None:
        if self._options is None:
            self._options = kafka_python_options(self.kafka_cfg)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def assign(self, topic: str, starts: dict[int, int]) -> None:
        if topic != self.topic:
            self._leaders = {}
        self.topic, self._positions, self._ready = topic, dict(starts), {}

    def position(self, partition: int) -> int | None:
        return self._positions.get(partition)

    def poll(self, max_records: int, timeout_s: float) -> list[Any]:
        partition = next((p for p in self._positions if p in self._ready), None)
        if partition is None and self._positions:
            partition = min(self._positions, key=lambda p: self._positions[p])
            try:
                self._ready[partition] = self._fetch(partition, timeout_s, max_records)
            except BrokerError as exc:
                self._last_error, self._leaders = str(exc), {}  # ask for the leaders again
                self._sent.clear()  # their connections are closed below
                self._drop(partition)
                raise
        if partition is None:
            return []
        records = self._ready.pop(partition)
        if len(records) > max_records:
            self._ready[partition], records = records[max_records:], records[:max_records]
        return records if len(records) else []  # type: ignore[return-value]

    def _connection(self, node: int) -> FetchConnection:
        if node not in self._connections:
            host, port = self._brokers[node]
            self.open()
            self._connections[node] = FetchConnection(host, port, self._options or {})
        return self._connections[node]

    def _drop(self, partition: int) -> None:
        """Close the connection to ``partition``'s last known leader (it may be gone)."""
        for node, connection in list(self._connections.items()):
            if node == self._leaders.get(partition) or not self._leaders:
                connection.close()
                del self._connections[node]

    def _leader(self, partition: int) -> int:
        if partition not in self._leaders:
            self._ask_metadata()
        leader = self._leaders.get(partition, -1)
        if leader < 0:
            raise BrokerError(f"no leader known for topic {self.topic!r} partition {partition}")
        return leader

    def _ask_metadata(self) -> None:
        self.open()
        options = self._options or {}
        errors = []
        for server in options["bootstrap_servers"]:
            host, _, port = server.rpartition(":")
            try:
                connection = FetchConnection(host, int(port), options)
            except BrokerError as exc:
                errors.append(str(exc))
                continue
            try:
                topics = [MetadataRequest.MetadataRequestTopic(name=self.topic)]
                request = MetadataRequest(topics=topics, allow_auto_topic_creation=False)  # never makes a topic
                response = connection.request(
                    request, MetadataResponse, connection.version(MetadataRequest, MAX_METADATA_VERSION)
                )
            finally:
                connection.close()
            self._brokers = {b.node_id: (b.host, b.port) for b in response.brokers}
            (topic,) = response.topics
            if topic.error_code:
                raise TopicError(f"topic {self.topic!r}: {kafka.errors.for_code(topic.error_code).__name__}")
            self._leaders = {p.partition_index: p.leader_id for p in topic.partitions}
            return
        raise BrokerError(f"no bootstrap server answered a Metadata request: {'; '.join(errors)}")

    def _fetch_bytes(self, records: int) -> int:
        """Bytes to ask for ``records`` records: what they took in the last response, with 10 % to spare, within
        [:data:`MIN_FETCH_BYTES`, ``reader.fetch_max_bytes``]. Each fetch is parsed whole, and a loader jumping to
        another block drops what its range did not need (a whole 16 MiB fetch per 3.3 MB block, otherwise)."""
        limit = self.reader_cfg.fetch_max_bytes
        if self._record_bytes is None:
            return limit
        return min(limit, max(MIN_FETCH_BYTES, int(records * self._record_bytes * 1.1)))

    def fetch_ahead(self, partition: int, offset: int, records: int) -> None:
        """Send the Fetch for ``records`` records of ``partition`` from ``offset`` now (unless it is in flight, or
        :data:`FETCHES_IN_FLIGHT` are): the broker answers while the caller works on what it has, and the poll that
        reads from there takes the answer. A poll that reads elsewhere first reads and drops the answers sent ahead of
        its own. Only a head start: a failure to send is left to that poll, which retries it as any fetch (this is
        called outside the reader's retries)."""
        if len(self._sent) >= FETCHES_IN_FLIGHT or any(sent[:2] == (partition, offset) for sent in self._sent):
            return
        try:
            self._sent.append(self._send(partition, offset, self.reader_cfg.poll_timeout_s, records))
        except (BrokerError, TopicError) as exc:
            log.debug("no Fetch sent ahead for topic %s partition %d: %s", self.topic, partition, exc)

    def _send(self, partition: int, offset: int, timeout_s: float, records: int) -> tuple[int, int, int, int]:
        """Send one Fetch; (partition, offset, node, correlation id)."""
        fetch_bytes = self._fetch_bytes(records)
        node = self._leader(partition)
        connection = self._connection(node)
        fetch_partition = FetchRequest.FetchTopic.FetchPartition(
            partition=partition,
            current_leader_epoch=-1,
            fetch_offset=offset,
            log_start_offset=-1,
            partition_max_bytes=fetch_bytes,
        )
        request = FetchRequest(
            replica_id=-1,
            max_wait_ms=min(FETCH_WAIT_MS, int(timeout_s * 1000)),
            min_bytes=1,
            max_bytes=fetch_bytes,
            isolation_level=READ_COMMITTED,
            session_id=0,
            session_epoch=-1,
            topics=[FetchRequest.FetchTopic(topic=self.topic, partitions=[fetch_partition])],
            forgotten_topics_data=[],
            rack_id="",
        )
        version = connection.version(FetchRequest, MAX_FETCH_VERSION)
        if version < MIN_FETCH_VERSION:
            raise BrokerError(f"broker {connection.address} speaks Fetch up to v{version}; read_committed needs v4")
        return partition, offset, node, connection.send(request, version)

    def _fetch(self, partition: int, timeout_s: float, records: int) -> RecordColumns:
        offset = self._positions[partition]
        while self._sent and self._sent[0][:2] != (partition, offset):
            self._receive(self._sent.popleft())  # sent for a read that did not come: its connection's next answer
        sent = self._sent.popleft() if self._sent else self._send(partition, offset, timeout_s, records)
        response = self._receive(sent)
        data = response.responses[0].partitions[0]
        self._check(partition, offset, data.error_code)
        try:
            parsed = parse_batches(bytes(data.records or b""), decompress, _aborted(data), from_offset=offset)
        except RecordBatchError as exc:
            raise CorruptRecordError(str(exc), topic=self.topic, partition=partition, offset=offset) from None
        self._positions[partition] = parsed.next_offset
        if len(parsed.fields.offsets):
            self._record_bytes = len(data.records) / len(parsed.fields.offsets)
        return RecordColumns(partition, parsed.buffer, parsed.fields, self.metadata)

    def _receive(self, sent: tuple[int, int, int, int]) -> Any:
        _, _, node, correlation = sent
        connection = self._connections[node]
        return connection.receive(FetchResponse, connection.version(FetchRequest, MAX_FETCH_VERSION), correlation)

    def _check(self, partition: int, offset: int, code: int) -> None:
        if not code:
            return
        error = kafka.errors.for_code(code)
        where = {"topic": self.topic, "partition": partition, "offset": offset}
        if error is _OUT_OF_RANGE:
            raise OffsetRangeError(f"offset out of range: {error.__name__}", **where)
        if error is _UNKNOWN_PARTITION:
            raise OffsetRangeError(f"unknown topic or partition: {error.__name__}", **where)
        raise BrokerError(f"fetch of topic {self.topic!r} partition {partition} at offset {offset}: {error.__name__}")

    def offset_bounds(self, topic: str, probes: Mapping[int, int]) -> dict[int, tuple[int, int]]:
        """Asked through a short-lived confluent consumer, as :class:`KafkaPythonConsumer` does."""
        with ConfluentConsumer(self.kafka_cfg, self.reader_cfg) as probe:
            return probe.offset_bounds(topic, probes, meanwhile=self.open)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections = {}
        self._sent.clear()


def _aborted(data: Any) -> list[tuple[int, int]]:
    return [(txn.producer_id, txn.first_offset) for txn in (data.aborted_transactions or [])]
