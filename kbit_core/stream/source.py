"""One rank's live partitions: fetch with no end, hand out batches in stream-index order, know where it stands.

A :class:`StreamSource` is the continuous trainer's train "loader". It reads its partitions from their next
offsets (``positions``), buffers what arrives, and gives out records merged in stream-index order, so a given
world size reads a backlog in a reproducible order. Each record is checked against the index its partition
must hold next: a gap, a repeat or a topic that was reset raises :class:`StreamGapError` naming the
coordinates. kbit's live producer keys each record with its stream index; a topic kbit did not write (a codec that
indexes from offsets: ``source.topic`` with a mapping) has no such keys, so a record's index is its place in the
stream, ``offset * partitions + partition``, and offsets may skip (transaction markers, compaction). A broker that
lost the topic (offsets past its log end) is reported and waited for, since the live producer produces the lost
records again at the same offsets. Lag is measured against the high watermark of
the fetch responses (the embedded broker's ListOffsets(LATEST) is wrong).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kbit_core.config import KbitConfig
from kbit_core.data.allocator import keep_freed_memory
from kbit_core.data.batching import Batch, to_batch
from kbit_core.errors import BrokerError, ConfigError, CorruptRecordError, SchemaRegistryError, TopicError
from kbit_core.formats import Codec
from kbit_core.formats.confluent.source import at_record
from kbit_core.kafka import offsets
from kbit_core.kafka.clients import ConsumerUse, open_consumer
from kbit_core.kafka.consumers import FETCH_WAIT_MS
from kbit_core.stream.ledger import IndexRuns, extend_runs

log = logging.getLogger(__name__)

# While starved, how often to ask the broker whether its log still reaches this rank's offsets.
END_CHECK_S = 5.0
# After finding it does not, how often to ask whether it does again, and how long one answer may take.
REFILL_CHECK_S = 0.5
REFILL_PROBE_TIMEOUT_S = 2.0
# Codes meaning "this partition's log no longer reaches our offset": the broker lost data or was replaced.
_RESET_CODES = (
    KafkaError.OFFSET_OUT_OF_RANGE,
    KafkaError._AUTO_OFFSET_RESET,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC,
)


class StreamGapError(TopicError):
    """A stream partition does not hold the index it must hold next: records were skipped, repeated or replaced."""


class _Pending(NamedTuple):
    offset: int
    index: int
    produced_ms: int
    value: bytes


@dataclass
class PartitionPosition:
    """Where one partition stands: the next offset and stream index to train, and the indices trained so far."""

    offset: int
    index: int | None  # None until the first record is seen (a fresh start from the beginning or a timestamp)
    trained: IndexRuns = field(default_factory=list)


class StreamSource:
    """Reads ``partitions`` of ``topic`` with confluent-kafka (each fetch's high watermark gives the lag); see the
    module docstring. Not thread-safe: the training loop owns it."""

    def __init__(
        self,
        cfg: KbitConfig,
        codec: Codec,
        topic: str,
        partitions: tuple[int, ...],
        num_partitions: int,
        *,
        first_offsets: dict[int, int] | None = None,
    ) -> None:
        self.cfg, self.codec, self.topic = cfg, codec, topic
        self.partitions, self.num_partitions = partitions, num_partitions
        if cfg.reader.keep_freed_memory:
            keep_freed_memory()
        # Offsets the stream never trains below (a user's topic: its held-out records come first).
        self.first_offsets = first_offsets or {}
        self.skipped = 0  # bad records left out under reader.bad_records=skip (a user's topic)
        self.positions: dict[int, PartitionPosition] = {}
        self.skip_before_ms = cfg.stream.start_timestamp_ms if cfg.stream.start == "timestamp" else None
        self._queues: dict[int, deque[_Pending]] = {p: deque() for p in partitions}
        self._high: dict[int, int] = {}
        self._consumer: Consumer | None = None
        self.resets = 0  # times a partition's log was found not to reach this rank's offset
        self._short = False  # within such an episode (reported once)
        self._ends_checked = 0.0

    def __len__(self) -> int:
        # A stream has no epochs; its evaluation window stands in for one where a learning-rate schedule asks.
        return self.cfg.stream.eval_every_steps

    # ---- positions -----------------------------------------------------------------------------------------

    def start_fresh(self) -> None:
        """Positions from ``stream.start`` (no checkpoint): the beginning, given offsets, or a produce time."""
        starts = dict.fromkeys(self.partitions, None)
        if self.cfg.stream.start == "offsets":
            starts.update({p: o for p, o in self.cfg.stream.start_offsets.items() if p in starts})
        missing = [p for p, offset in starts.items() if offset is None]
        if missing:
            # The embedded broker answers ListOffsets(timestamp) with 0, so a timestamp start reads from the
            # beginning and skips what was produced before it.
            starts.update(self._wait_for(lambda: offsets.earliest_offsets(self.cfg.kafka, self.topic, missing)))
        self.positions = {
            p: PartitionPosition(offset=max(o, self.first_offsets.get(p, 0)), index=None) for p, o in starts.items()
        }

    def load_positions(self, offsets: list[int], indices: list[int | None], trained: list[IndexRuns]) -> None:
        """Continue from a checkpoint's per-partition next offsets and indices (any world size wrote it)."""
        if len(offsets) != self.num_partitions:
            raise ConfigError(
                f"the checkpoint holds {len(offsets)} partition positions; topic {self.topic!r} has "
                f"{self.num_partitions} partitions"
            )
        self.positions = {
            p: PartitionPosition(offsets[p], indices[p], [list(r) for r in trained[p]]) for p in self.partitions
        }

    def state(self) -> dict[int, dict[str, Any]]:
        """This rank's partitions: next offset, next index and trained runs (what a checkpoint carries)."""
        return {
            p: {"offset": pos.offset, "index": pos.index, "trained": pos.trained} for p, pos in self.positions.items()
        }

    # ---- reading -------------------------------------------------------------------------------------------

    def _connect(self) -> Consumer:
        use = ConsumerUse(
            purpose="stream",
            group=f"kbit-stream-{self.topic}",
            fetch_wait_ms=FETCH_WAIT_MS,
            tuning={"fetch.queue.backoff.ms": FETCH_WAIT_MS},
        )
        consumer = open_consumer(self.cfg.kafka, use)
        # Fetch from past what is already buffered, so nothing arrives twice.
        consumer.assign([TopicPartition(self.topic, p, self._fetch_offset(p)) for p in self.partitions])
        return consumer

    def _wait_for(self, query: Any) -> Any:
        deadline = time.monotonic() + self.cfg.stream.idle_timeout_s
        while True:
            try:
                return query()
            except (BrokerError, TopicError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("stream %s: waiting (%s)", self.topic, exc)
                time.sleep(0.5)

    def poll(self, timeout_s: float) -> int:
        """Fetch what arrives within ``timeout_s`` into the buffers; the number of records received."""
        if self._consumer is None:
            if self._short:
                if not self._log_reaches_offsets():
                    time.sleep(timeout_s)
                    return 0
                self._short = False  # the episode is over: the log reaches this rank's offsets again
            self._consumer = self._connect()
        received = 0
        for msg in self._consumer.consume(num_messages=self.cfg.reader.max_poll_records, timeout=timeout_s):
            err = msg.error()
            if err is not None:
                if err.code() in _RESET_CODES:
                    self._reset(msg.partition(), err.str())
                    return received
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                log.debug("stream %s: consumer error %s", self.topic, err.str())
                continue
            partition, produced_ms = msg.partition(), msg.timestamp()[1]
            if (
                self.skip_before_ms is not None
                and produced_ms < self.skip_before_ms
                and self.positions[partition].index is None
            ):
                self.positions[partition].offset = msg.offset() + 1  # before the start time: not part of this run
                continue
            self._queues[partition].append(_Pending(msg.offset(), self._index(msg), produced_ms, msg.value()))
            received += 1
        for p in self.partitions:
            _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            if high >= 0:
                self._high[p] = high
        return received

    def _index(self, msg: Any) -> int:
        """A record's stream index: its key (kbit's live producer), else its place by offset (a user's topic)."""
        if self.codec.index_from_offsets:
            return msg.offset() * self.num_partitions + msg.partition()
        return int(msg.key() or b"-1")

    def _reset(self, partition: int, detail: str) -> None:
        """The broker's log for ``partition`` does not reach our offset: say so, drop what is buffered, wait for
        the producer to produce it again (the memory-only broker loses everything on restart)."""
        if not self._short:
            self.resets += 1
            log.warning(
                "stream %s[%d]: the broker's log does not reach offset %d, where this rank continues (%s): "
                "the broker lost data or the topic was recreated; waiting for the live producer to produce it "
                "again",
                self.topic,
                partition,
                self.positions[partition].offset,
                detail,
            )
        self._short = True
        for queue in self._queues.values():
            queue.clear()
        self._high.clear()
        self._ends_checked = time.monotonic()  # the next look at the log ends is due in REFILL_CHECK_S
        self.close()

    def _log_reaches_offsets(self) -> bool:
        """After a reset: does the topic have the stream's partitions again, and every partition's log reach where
        this rank continues (the producer refilled it)? Until then this rank holds no consumer, only a probe for a
        few milliseconds every REFILL_CHECK_S: librdkafka 2.16 crashes the process (SIGSEGV) when a topic is
        deleted and created again under a consumer assigned to it, as the live producer does to a topic that holds
        records in the wrong places. A broker slow to answer delays the probe's verdict, not the stop checks."""
        if time.monotonic() - self._ends_checked < REFILL_CHECK_S:
            return False
        self._ends_checked = time.monotonic()
        kcfg = self.cfg.kafka.model_copy(
            update={"request_timeout_s": min(REFILL_PROBE_TIMEOUT_S, self.cfg.kafka.request_timeout_s)}
        )
        try:
            ends = offsets.exact_end_offsets(kcfg, self.topic)  # every partition: the count tells the stream's topic
        except (BrokerError, TopicError):
            return False
        # a topic with other partitions is not the stream's (yet): the producer recreates it
        return len(ends) == self.num_partitions and all(ends[p] >= self._fetch_offset(p) for p in self.partitions)

    def _check_log_ends(self) -> None:
        """Starved: does the broker's log still reach where this rank reads? librdkafka stays silent about a topic
        that vanished with its broker, so the ends are asked for directly (at most every END_CHECK_S)."""
        if time.monotonic() - self._ends_checked < END_CHECK_S:
            return
        self._ends_checked = time.monotonic()
        try:
            ends = offsets.exact_end_offsets(self.cfg.kafka, self.topic, self.partitions)
        except (BrokerError, TopicError) as exc:
            ends, detail = {}, str(exc)
        else:
            detail = f"log ends {ends}"
        short = [p for p in self.partitions if ends.get(p, -1) < self._fetch_offset(p)]
        if short:
            self._reset(short[0], detail)

    def _fetch_offset(self, partition: int) -> int:
        queue = self._queues[partition]
        return queue[-1].offset + 1 if queue else self.positions[partition].offset

    def ready(self, limit: int) -> int:
        """Records (at most ``limit``) that can be handed out in stream-index order now: a partition whose next
        index is the lowest and whose buffer is empty blocks the merge."""
        heads = {p: 0 for p in self.partitions}
        count = 0
        while count < limit:
            p = min(self.partitions, key=lambda q: self._expected(q, heads[q]))
            if heads[p] >= len(self._queues[p]):
                return count
            heads[p] += 1
            count += 1
        return count

    def buffered(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _expected(self, partition: int, ahead: int) -> float:
        """The stream index ``ahead`` records past ``partition``'s next (its buffered head when not known yet)."""
        pos, queue = self.positions[partition], self._queues[partition]
        if ahead < len(queue):
            return queue[ahead].index
        if pos.index is None:
            return float("inf") if not queue else queue[-1].index + (ahead - len(queue) + 1) * self.num_partitions
        return pos.index + ahead * self.num_partitions

    def fill(self, want: int, timeout_s: float) -> int:
        """Fetch until ``want`` records are ready in index order or ``timeout_s`` passed; records ready (after the
        timeout, whatever is buffered: a starved partition waited long enough)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.ready(want)
            left = deadline - time.monotonic()
            if ready >= want:
                return ready
            if left <= 0:
                if not self.buffered():
                    self._check_log_ends()
                return ready or min(want, self.buffered())
            self.poll(min(left, 0.05))

    def take(self, count: int) -> Batch:
        """Remove ``count`` buffered records, lowest stream index first, check each against its partition's next
        index, and decode them. The positions and the ledger of trained indices advance only once the batch
        decoded: a batch that fails (a record, the registry) leaves its records buffered and untrained."""
        chosen: list[tuple[int, _Pending]] = []
        for _ in range(count):
            p = min((q for q in self.partitions if self._queues[q]), key=lambda q: self._queues[q][0].index)
            chosen.append((p, self._queues[p].popleft()))
        try:
            advanced = self._checked_positions(chosen)
            batch = self._user_batch(chosen) if self.codec.index_from_offsets else self._kbit_batch(chosen)
        except BaseException:
            for p, rec in reversed(chosen):
                self._queues[p].appendleft(rec)
            raise
        for p, (offset, index) in advanced.items():
            self.positions[p].offset, self.positions[p].index = offset, index
        for p, rec in chosen:
            extend_runs(self.positions[p].trained, [rec.index], self.num_partitions)
        return batch

    def _checked_positions(self, chosen: list[tuple[int, _Pending]]) -> dict[int, tuple[int, int | None]]:
        """Each partition's next offset and index after ``chosen``; StreamGapError when a record is not the one its
        partition must hold next."""
        advanced = {p: (pos.offset, pos.index) for p, pos in self.positions.items()}
        for p, rec in chosen:
            offset, index = advanced[p]
            if self.codec.index_from_offsets and rec.offset >= offset:
                offset, index = rec.offset, rec.index  # a user's offsets may skip; the index follows them
            if rec.offset != offset or (index is not None and rec.index != index):
                raise StreamGapError(
                    f"stream {self.topic}[{p}] at offset {rec.offset} holds index {rec.index}; the "
                    f"next to train is offset {offset}, index {index}: records were "
                    "skipped, repeated or replaced (was the topic recreated by another producer?)"
                )
            if rec.index % self.num_partitions != p:
                raise StreamGapError(
                    f"stream {self.topic}[{p}] at offset {rec.offset} holds index {rec.index}, "
                    f"which belongs to partition {rec.index % self.num_partitions}"
                )
            advanced[p] = (rec.offset + 1, rec.index + self.num_partitions)
        return advanced

    def _kbit_batch(self, chosen: list[tuple[int, _Pending]]) -> Batch:
        """kbit's own records decoded; their keys (the stream indices) must agree with the values'."""
        decoded = self.codec.decode([rec.value for _, rec in chosen])
        if not np.array_equal(decoded.indices, [rec.index for _, rec in chosen]):
            raise StreamGapError(
                f"stream {self.topic}: record keys and values disagree on the indices "
                f"(partition/offset of the first: {chosen[0][0]}/{chosen[0][1].offset})"
            )
        produced_ms = np.array([rec.produced_ms for _, rec in chosen], dtype=np.int64)
        # a fast decoder's float lists are a read-only view of its own buffer; the training step gets a tensor of its own
        pixels = decoded.pixels if decoded.pixels.flags.writeable else decoded.pixels.copy()
        return to_batch(pixels, decoded.labels, decoded.indices)._replace(produced_ms=produced_ms)

    def _user_batch(self, chosen: list[tuple[int, _Pending]]) -> Batch:
        """A user's records decoded by the mapping, indexed by their place in the stream; a record that does not
        decode fails naming its coordinates, or under ``reader.bad_records=skip`` is left out and counted."""
        values = [rec.value for _, rec in chosen]
        try:
            decoded = self.codec.decode(values)
        except SchemaRegistryError as exc:  # the registry failed, no record: never skipped, named where it stopped
            raise at_record(exc, self.topic, [(p, rec.offset, rec.value) for p, rec in chosen]) from None
        except CorruptRecordError:
            failed = dict(self.codec.failing_values(values))
            for position, reason in failed.items():
                p, rec = chosen[position]
                error = CorruptRecordError(
                    f"the record does not fit source.mapping: {reason}",
                    topic=self.topic,
                    partition=p,
                    offset=rec.offset,
                )
                # every rank steps together, so a batch left empty cannot be skipped: it fails as a bad record does
                if len(failed) == len(chosen) or (
                    self.cfg.reader.bad_records == "fail" and not self.codec.skips(reason)
                ):
                    raise error from None
                log.warning("skipping a bad record (%s)", error)
            self.skipped += len(failed)
            chosen = [pick for position, pick in enumerate(chosen) if position not in failed]
            decoded = self.codec.decode([rec.value for _, rec in chosen])
        indices = np.array([rec.index for _, rec in chosen], dtype=np.int64)
        produced_ms = np.array([rec.produced_ms for _, rec in chosen], dtype=np.int64)
        # bytes features are a read-only view of the values; the training step gets a tensor of its own
        pixels = decoded.pixels if decoded.pixels.flags.writeable else decoded.pixels.copy()
        return to_batch(pixels, decoded.labels, indices)._replace(produced_ms=produced_ms)

    # ---- lag -----------------------------------------------------------------------------------------------

    def lag(self, now_ms: int) -> dict[int, tuple[int, float]]:
        """Per partition: records behind the head (fetch high watermark) and seconds since the oldest untrained
        record was produced (0 when caught up)."""
        out = {}
        for p, pos in self.positions.items():
            queue = self._queues[p]
            behind = max(0, self._high.get(p, pos.offset) - pos.offset)
            seconds = (now_ms - queue[0].produced_ms) / 1000 if queue and behind else 0.0
            out[p] = (behind, max(0.0, seconds))
        return out

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
