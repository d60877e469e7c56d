"""RangeReader: read exactly the planned offset ranges of a topic, checked, retried, and decoded.

The original stopped at the first empty 3 s poll, kept partial data after a decode error, and accepted a
record below the requested start. Here the end of a range comes from the plan, every offset is checked
against ``[start, stop)``, an empty poll is only a reason to wait (up to ``reader.deadline_s`` without
progress), and a bad record is either an error naming its coordinates or a counted skip.
"""

from __future__ import annotations

import gc
import logging
import operator
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kbit_core.config import ClientName, KafkaConfig, ReaderConfig
from kbit_core.data.allocator import keep_freed_memory
from kbit_core.data.decode_pool import DecodePool
from kbit_core.errors import BrokerError, CorruptRecordError, OffsetRangeError, ReadTimeoutError, SchemaRegistryError
from kbit_core.formats.confluent.source import at_record
from kbit_core.kafka.batch_consumer import BatchConsumer
from kbit_core.kafka.consumers import ConsumerBackend, RawRecord, make_consumer
from kbit_core.kafka.record_columns import RecordColumns
from kbit_core.sharding import OffsetRange

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 1.0

_VALUE = operator.attrgetter("value")


def continues_at(batch: Sequence[RawRecord], partition: int, offset: int) -> bool:
    """Whether ``batch`` holds exactly the offsets ``offset, offset + 1, ...`` of ``partition``, in order (a poll
    without gaps, re-deliveries or other partitions): checked over columns, without a Python step per record."""
    count = len(batch)
    if isinstance(batch, RecordColumns):  # one partition, offsets rising: whole when its ends are
        offsets = batch.offsets
        return (
            batch.partition == partition and bool(count) and offsets[0] == offset and offsets[-1] == offset + count - 1
        )
    partitions = np.fromiter(map(operator.itemgetter(0), batch), np.int64, count)
    offsets = np.fromiter(map(operator.itemgetter(1), batch), np.int64, count)
    return bool((partitions == partition).all()) and np.array_equal(offsets, np.arange(offset, offset + count))


def _joined(parts: Sequence[Sequence[RawRecord]]) -> Sequence[RawRecord]:
    """One range's polled parts as one sequence: fetched columns stay columns."""
    if parts and all(isinstance(part, RecordColumns) for part in parts):
        return RecordColumns.concat([part for part in parts if len(part)] or list(parts[:1]))  # type: ignore[arg-type]
    return [record for part in parts for record in part]


class _CollectorPause:
    """Automatic cyclic garbage collection held off while any reader polls a range (a count of the threads inside).
    A fetch allocates a record per message, and the collections those allocations trigger walked the whole heap (the
    imports' ~200k objects): measured 4.5 µs of CPU per message with them, 1.4 µs without (docs/data_plane_benchmark.md,
    issue 32). A record holds no cycle, so nothing is lost: the collections run again when the range is read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if not self._inside:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside and self._was_enabled:
                gc.enable()


_COLLECTOR_PAUSE = _CollectorPause()


@dataclass
class ReaderStats:
    """Counters of everything read; ``skipped`` and ``gaps`` are never silently zero when data was lost."""

    messages: int = 0
    records: int = 0
    bytes: int = 0
    skipped: int = 0  # corrupt messages left out under bad_records='skip', each counted once
    gaps: int = 0  # offsets missing inside planned ranges (transaction markers, compaction)
    retries: int = 0  # transient client errors retried
    kafka_clients: int = 0  # Kafka clients opened: the consumer, and any client it asks the bounds with
    fetch_seconds: float = 0.0
    decode_seconds: float = 0.0


class RangeReader:
    """Reads planned :class:`OffsetRange` s of ``topic`` with one consumer, reused across calls.

    Consecutive ranges of one call that continue where the previous one stopped are read without a new seek;
    between calls the consumer holds no assignment. Several loaders may share one reader (one consumer, which
    also asks the broker's offset bounds once per partition): each range is fetched, and the bounds asked, under
    a lock and re-seeks when another caller moved the consumer, so interleaved or concurrent readers still get
    exactly their ranges.
    Callers bound memory through the size of the ranges they pass (see ``sharding.block_order``).
    """

    def __init__(
        self,
        kafka_cfg: KafkaConfig,
        reader_cfg: ReaderConfig,
        topic: str,
        codec: Any,
        client: ClientName | None = None,
        *,
        metadata: bool | None = None,
    ) -> None:
        self.kafka_cfg, self.reader_cfg, self.topic, self.codec = kafka_cfg, reader_cfg, topic, codec
        if reader_cfg.keep_freed_memory:
            keep_freed_memory()
        self.client: ClientName = client or kafka_cfg.client
        self.stats = ReaderStats()
        self._consumer: ConsumerBackend | None = None
        self._position: tuple[int, int] | None = None  # (partition, next offset the consumer delivers)
        self._carry: list[RawRecord] = []  # records polled past the last range's stop
        self._bounds: dict[int, tuple[int, int]] = {}  # partition -> (earliest, end) on the broker
        # (partition, offset) of each corrupt message skipped: counted once, however many epochs read it again
        self._skipped_at: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._decoder: Any = DecodePool(codec, reader_cfg.decode_processes) if reader_cfg.decode_processes else codec
        # key, headers and timestamps are polled only for a codec that reads them (a mapping naming @key...)
        self.metadata = bool(getattr(codec, "reads_metadata", False)) if metadata is None else metadata

    @property
    def fetched_by(self) -> str:
        """What fetches the ranges, for messages: the client's consumer, or kbit's own Fetch requests."""
        return (
            self.client if self.reader_cfg.fetch == "messages" else "kbit's own Fetch requests (reader.fetch: batches)"
        )

    def connect(self, ranges: Sequence[OffsetRange] = ()) -> None:
        """Check ``ranges`` through the consumer and have it connected, so the reads that follow make no set-up
        round trip of their own (the check's fetch already connected a confluent consumer to the partition
        leaders)."""
        self.check(ranges)
        with self._lock:
            self._open().open()

    def _open(self) -> ConsumerBackend:
        if self._consumer is None:
            if self.reader_cfg.fetch == "batches":
                self._consumer = BatchConsumer(self.kafka_cfg, self.reader_cfg, metadata=self.metadata)
            else:
                self._consumer = make_consumer(self.kafka_cfg, self.reader_cfg, self.client, metadata=self.metadata)
            self.stats.kafka_clients += 1
        return self._consumer

    # -- checks ------------------------------------------------------------------------------------

    def check(self, ranges: Sequence[OffsetRange]) -> None:
        """Fail fast unless every range lies inside what the broker stores (topic, partition, offsets).

        The bounds of partitions not asked yet come from one fetch with the reader's consumer (see
        ``ConsumerBackend.offset_bounds``) where the ranges end in each: usually the log end, which returns nothing.

        Raises:
            TopicError: the topic or a partition does not exist.
            OffsetRangeError: a range starts below the earliest stored offset or ends past the log end.
        """
        ends: dict[int, int] = {}
        for r in ranges:
            if len(r) and r.partition not in self._bounds:
                ends[r.partition] = max(r.stop, ends.get(r.partition, r.stop))
        if ends:
            with self._lock:
                consumer = self._open()
                self._bounds.update(consumer.offset_bounds(self.topic, ends))
                self._position, self._carry = None, []  # the probe moved the consumer
                self.stats.kafka_clients += consumer.bounds_opens_client
        for r in ranges:
            if not len(r):
                continue
            low, end = self._bounds[r.partition]
            if r.start < low or r.stop > end:
                raise OffsetRangeError(
                    f"planned range [{r.start}, {r.stop}) is outside the stored offsets [{low}, {end}) "
                    f"(data deleted, topic recreated, or a manifest from another topic?)",
                    topic=self.topic,
                    partition=r.partition,
                    offset=r.start if r.start < low else end,
                )

    # -- raw fetch ---------------------------------------------------------------------------------

    def read_raw(self, ranges: Sequence[OffsetRange]) -> Iterator[tuple[OffsetRange, Sequence[RawRecord]]]:
        """Yield each non-empty range with its records, in the order given, after :meth:`check`."""
        self.check(ranges)
        planned = [r for r in ranges if len(r)]
        # where the run of ranges each continuing the one before ends, per range: a fetch ahead asks for all of it
        run_stops = [r.stop for r in planned]
        for i in range(len(planned) - 2, -1, -1):
            if (planned[i + 1].partition, planned[i + 1].start) == (planned[i].partition, planned[i].stop):
                run_stops[i] = run_stops[i + 1]
        try:
            for i, r in enumerate(planned):
                following = planned[i + 1] if i + 1 < len(planned) else None
                # This range's Fetch, then the next range's, go out before this range is read, so the broker reads
                # the next while this one is parsed and handed over; a next range continuing this one starts where
                # this range's fetch stops, known only once it is read.
                continues = following is not None and (following.partition, following.start) == (r.partition, r.stop)
                self._fetch_ahead(r, run_stops[i])
                if following is not None and not continues:
                    self._fetch_ahead(following, run_stops[i + 1])
                records = self._fetch(r)
                if following is not None and continues:
                    self._fetch_ahead(following, run_stops[i + 1])
                yield r, records
        finally:
            self._release()

    def _fetch_ahead(self, rng: OffsetRange, run_stop: int) -> None:
        """Have a consumer that can (reader.fetch: batches) ask for ``rng`` and the ranges that continue it, up to
        ``run_stop``, now, so that the broker answers while the ranges before it are read and decoded: from its
        start, or, when the last range read ends where it starts, from where the consumer stopped fetching (what it
        fetched past that range's end is carried into this one). Nothing is sent twice."""
        with self._lock:
            consumer = self._consumer
            if not isinstance(consumer, BatchConsumer) or consumer.topic != self.topic:
                return  # a consumer not yet assigned this topic (before the first range is read) has nowhere to send
            start = rng.start
            if self._position == (rng.partition, rng.start):
                start = consumer.position(rng.partition) or rng.start
            if start < rng.stop:
                consumer.fetch_ahead(rng.partition, start, run_stop - start)

    def _release(self) -> None:
        # An idle assigned consumer keeps prefetching past the last range and polling the log end.
        with self._lock:
            if self._consumer is not None and self._position is not None:
                self._consumer.assign(self.topic, {})
            self._position, self._carry = None, []

    def _consumer_at(self, partition: int, offset: int) -> ConsumerBackend:
        consumer = self._open()
        if self._position != (partition, offset):
            consumer.assign(self.topic, {partition: offset})
            self._carry = []
        return consumer

    def _fetch(self, rng: OffsetRange) -> Sequence[RawRecord]:
        with self._lock, _COLLECTOR_PAUSE:
            return self._fetch_locked(rng)

    def _fetch_locked(self, rng: OffsetRange) -> Sequence[RawRecord]:
        t0 = time.perf_counter()
        consumer = self._consumer_at(rng.partition, rng.start)
        self._position = None  # unknown until this range completes
        cfg = self.reader_cfg
        parts: list[Sequence[RawRecord]] = []
        next_offset = rng.start
        pending, self._carry = self._carry, []
        last_progress, backoff, last_error = time.monotonic(), 0.05, None
        while next_offset < rng.stop:
            if pending:
                batch, pending = pending, []
            else:
                try:
                    batch = consumer.poll(min(cfg.max_poll_records, rng.stop - next_offset), cfg.poll_timeout_s)
                except BrokerError as exc:
                    self.stats.retries += 1
                    last_error = str(exc)
                    batch = []
                    time.sleep(backoff)
                    backoff = min(2 * backoff, MAX_BACKOFF_S)
            before = next_offset
            if batch and continues_at(batch, rng.partition, next_offset):
                take = min(len(batch), rng.stop - next_offset)
                parts.append(batch[:take])
                self._carry = batch[take:]
                next_offset += take
            elif isinstance(batch, RecordColumns):
                next_offset = self._take_columns(rng, batch, next_offset, parts)
            else:
                parts.append([])
                next_offset = self._take_each(rng, batch, next_offset, parts[-1])
            if not batch and next_offset < rng.stop and (consumer.position(rng.partition) or 0) >= rng.stop:
                # The consumer moved past the range's end without delivering its last offsets: they hold
                # control records (a transaction's marker at the log end) or were compacted away.
                next_offset = self._gap(rng, next_offset, rng.stop)
            if next_offset > before:
                last_progress, backoff = time.monotonic(), 0.05
            elif time.monotonic() - last_progress > cfg.deadline_s:
                raise ReadTimeoutError(
                    f"no progress for {cfg.deadline_s:g}s reading planned range [{rng.start}, {rng.stop}) with "
                    f"{self.fetched_by}: {next_offset - rng.start} of {len(rng)} offsets read, expecting offset "
                    f"{next_offset} next; last client error: {last_error or consumer.last_error or 'none'}",
                    topic=self.topic,
                    partition=rng.partition,
                    offset=next_offset,
                )
        self._position = (rng.partition, rng.stop)
        records = _joined(parts)
        self.stats.messages += len(records)
        if isinstance(records, RecordColumns):
            self.stats.bytes += records.value_bytes
        else:
            self.stats.bytes += sum(map(len, filter(None, map(_VALUE, records))))  # None (no value) counts no bytes
        self.stats.fetch_seconds += time.perf_counter() - t0
        return records

    def _take_each(self, rng: OffsetRange, batch: list[RawRecord], next_offset: int, records: list[RawRecord]) -> int:
        """Append the records of ``batch`` that belong to ``rng`` from ``next_offset`` on, one by one, counting the
        offsets missing between them and carrying what lies past its stop; returns the next offset expected."""
        for i, rec in enumerate(batch):
            if rec.partition != rng.partition or rec.offset < next_offset:
                continue  # the head of a compressed batch before our start, or a re-delivery: never ours
            if rec.offset >= rng.stop:
                self._carry = [x for x in batch[i:] if x.partition == rng.partition]
                return self._gap(rng, next_offset, rng.stop)
            records.append(rec)
            next_offset = self._gap(rng, next_offset, rec.offset) + 1
        return next_offset

    def _take_columns(
        self, rng: OffsetRange, batch: RecordColumns, next_offset: int, parts: list[Sequence[RawRecord]]
    ) -> int:
        """:meth:`_take_each` for fetched columns (one partition, offsets rising), without a step per record."""
        if batch.partition != rng.partition:
            return next_offset
        low, high = np.searchsorted(batch.offsets, [next_offset, rng.stop]).tolist()
        taken = batch[low:high]
        offsets = taken.offsets
        before = np.concatenate(([next_offset - 1], offsets[:-1]))
        for after, found in zip(before[offsets - before > 1].tolist(), offsets[offsets - before > 1].tolist()):
            self._gap(rng, after + 1, found)
        parts.append(taken)
        next_offset = int(offsets[-1]) + 1 if len(offsets) else next_offset
        if high < len(batch):
            self._carry = batch[high:]
            return self._gap(rng, next_offset, rng.stop)
        return next_offset

    def _gap(self, rng: OffsetRange, expected: int, found: int) -> int:
        """Count offsets ``[expected, found)`` of ``rng`` as missing (logged); returns ``found``."""
        if found > expected:
            self.stats.gaps += found - expected
            log.warning(
                "topic %s partition %d: offsets %d..%d are missing inside planned range %s "
                "(transaction markers or compaction)",
                self.topic,
                rng.partition,
                expected,
                found - 1,
                rng,
            )
        return found

    # -- decode ------------------------------------------------------------------------------------

    def read(self, ranges: Sequence[OffsetRange]) -> Iterator[tuple[OffsetRange, Any]]:
        """Yield ``(range, DecodedBatch)`` per range; a range whose messages were all skipped yields nothing."""
        return self.decode_ranges(self.read_raw(ranges))

    def decode_ranges(
        self, fetched: Iterable[tuple[OffsetRange, Sequence[RawRecord]]]
    ) -> Iterator[tuple[OffsetRange, Any]]:
        """Decode what :meth:`read_raw` yielded (possibly fetched ahead on another thread), as :meth:`read` does."""
        for rng, records in fetched:
            batch = self.decode(records)
            if batch is not None:
                yield rng, batch

    def decode(self, records: Sequence[RawRecord]) -> Any:
        """Decode ``records`` together; if that fails, one by one to find the culprits (fail or skip them)."""
        t0 = time.perf_counter()
        good = records
        inputs = self.codec.decode_inputs
        try:
            batch = self._decoder.decode(inputs(records))
        except SchemaRegistryError as exc:  # the registry failed, no record: never skipped, named where it stopped
            raise at_record(exc, self.topic, [(r.partition, r.offset, r.value) for r in records]) from None
        except Exception:  # any codec failure means a bad value somewhere; localise it below
            good = self._good_records(records)
            batch = self.codec.decode(inputs(good)) if good else None
        if batch is not None and self.codec.index_from_offsets:
            batch = self.codec.indexed(batch, good)
        self.stats.decode_seconds += time.perf_counter() - t0
        if batch is not None:
            self.stats.records += len(batch.indices)
        return batch

    def _good_records(self, records: Sequence[RawRecord]) -> list[RawRecord]:
        failed = dict(self.codec.failing_values(self.codec.decode_inputs(records)))
        good = []
        for position, rec in enumerate(records):
            if position not in failed:
                good.append(rec)
                continue
            exc = (
                ValueError("the message has no value (null)")
                if rec.value is None
                else self.codec.corrupt_value_error(0, 1, rec.value, failed[position])
            )
            where = {"topic": self.topic, "partition": rec.partition, "offset": rec.offset}
            what = f"message does not decode as {self.codec.format}/{self.codec.layout}: {exc}"
            if self.reader_cfg.bad_records == "fail" and not self.codec.skips(failed[position]):
                raise CorruptRecordError(what, **where) from exc
            if (rec.partition, rec.offset) not in self._skipped_at:
                self._skipped_at.add((rec.partition, rec.offset))
                self.stats.skipped += 1
                log.warning("skipping corrupt record (%s)", CorruptRecordError(what, **where))
        return good

    def close(self) -> None:
        if isinstance(self._decoder, DecodePool):
            self._decoder.close()
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
            self._position, self._carry = None, []

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
