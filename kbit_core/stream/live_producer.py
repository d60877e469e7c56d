"""`kbit produce --stream`: append dataset records to a stream topic at a target rate, and survive broker restarts.

Stream index ``i`` carries dataset record ``i % dataset.num_records`` (the dataset cycles; the index keeps
counting) and goes to partition ``i % partitions`` with key ``i``; the Kafka message timestamp is the produce
time. After every acknowledged chunk the producer appends its segments to the stream manifest
(:mod:`kbit_core.stream.stream_log`). When the broker goes away it reconnects and compares the topic with the
manifest: a broker that lost records (the memory-only embedded broker loses everything on restart) gets them
produced again, at the same offsets, before the stream goes on from the manifest's next index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kbit_core.config import KbitConfig
from kbit_core.datasets import DatasetSource, open_source
from kbit_core.errors import BrokerError, ConfigError, TopicError
from kbit_core.formats import Codec, RecordShape, variant_codec
from kbit_core.kafka import admin, offsets
from kbit_core.kafka.producers import DeliveryLedger, ProducerBackend, delivery_timeout_ms, make_producer
from kbit_core.stream.stream_log import Segment, StreamLog, stream_log_path

log = logging.getLogger(__name__)

# Records per send-and-acknowledge round: the manifest grows by at most this much at a time.
MAX_CHUNK = 4096
# How often the producer wakes to send what the rate allows.
TICK_S = 0.02
# An acknowledgement slower than this means the (single) broker is gone: reconnect instead of waiting out librdkafka.
ACK_TIMEOUT_S = 10.0


@dataclass
class StreamRun:
    """What one `kbit produce --stream` run did."""

    topic: str
    manifest_path: str
    produced: int  # new records appended by this run
    next_index: int  # the stream's next index (all runs together)
    seconds: float
    target_rate: float
    refilled: int  # records produced again after the broker lost them
    reconnects: int

    @property
    def achieved_rate(self) -> float:
        return self.produced / self.seconds if self.seconds > 0 else 0.0


def stream_header(cfg: KbitConfig, source: DatasetSource, fingerprint: str) -> dict[str, Any]:
    """What identifies a stream: a manifest or checkpoint of another stream must not be continued."""
    return {
        "topic": cfg.stream.topic_for(cfg.dataset, cfg.produce),
        "partitions": cfg.produce.partitions,
        "variant": cfg.produce.variant.model_dump(mode="json"),
        "dataset": {"name": source.name, "seed": cfg.dataset.seed, "num_records": source.num_records},
        "image_shape": list(source.image_shape),
        "num_classes": source.num_classes,
        "schema_fingerprint": fingerprint,
    }


def stream_codec(cfg: KbitConfig, records: RecordShape) -> Codec:
    """The codec of ``cfg``'s stream, for the producer that writes it and the ranks that decode it with
    ``reader.decoder``. A stream carries one record per message, so that each record has its own offset and
    produce time."""
    variant = cfg.produce.variant
    if variant.records_per_message != 1:
        raise ConfigError(
            "a stream carries one record per message (produce.variant.records_per_message=1), "
            "so that each record has its own offset and produce time"
        )
    if variant.framing != "kbit":
        raise ConfigError("a stream is written in kbit's framing (produce.variant.framing: kbit)")
    return variant_codec(variant, records, cfg.reader.decoder)


class LiveProducer:
    """Appends the stream of ``cfg`` (``stream.topic_for``) at a target rate; see the module docstring."""

    def __init__(self, cfg: KbitConfig) -> None:
        self.cfg = cfg
        self.topic = cfg.stream.topic_for(cfg.dataset, cfg.produce)
        self.partitions = cfg.produce.partitions
        self.source = open_source(cfg.dataset)
        self.codec = stream_codec(cfg, self.source)
        self.log = StreamLog.open(
            stream_log_path(cfg.workdir, self.topic), stream_header(cfg, self.source, self.codec.schema_fingerprint())
        )
        self.refilled = self.reconnects = 0
        # A replicated cluster moves a lost leader's partitions (a broker cut off is fenced after its session
        # timeout, ~10 s): the idempotent producer's retries reach the new leader within the delivery timeout. Giving
        # up on a chunk earlier left its acknowledged part out of the manifest, and the retried chunk then found its
        # own records in the topic (a 30 s cut-off on the bed).
        replicated = cfg.kafka.topic_replication_factor > 1
        self.ack_timeout_s = delivery_timeout_ms(cfg.kafka) / 1000 + 5 if replicated else ACK_TIMEOUT_S
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def run(
        self,
        *,
        rate: float | None = None,
        duration_s: float | None = None,
        records: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> StreamRun:
        """Produce until ``duration_s`` passed, the stream holds ``records`` records, or ``should_stop()``."""
        rate = rate or self.cfg.stream.rate
        duration_s = duration_s if duration_s is not None else self.cfg.stream.duration_s
        records = records if records is not None else self.cfg.stream.records
        started = time.monotonic()
        first = self.log.next_index()
        backend: ProducerBackend | None = None
        # The schedule restarts after each reconnect, so an outage is not followed by a burst.
        schedule_start, schedule_first = started, first
        try:
            while not should_stop():
                now = time.monotonic()
                if duration_s is not None and now - started >= duration_s:
                    break
                if records is not None and self.log.next_index() >= records:
                    break
                if backend is None:
                    backend = self._connect()
                    schedule_start, schedule_first = time.monotonic(), self.log.next_index()
                    continue
                due = schedule_first + int(rate * (now - schedule_start))
                if records is not None:
                    due = min(due, records)
                start = self.log.next_index()
                if due <= start:
                    time.sleep(TICK_S)
                    continue
                try:
                    self._append(backend, start, min(due, start + MAX_CHUNK))
                except BrokerError as exc:
                    log.warning("stream %s: lost the broker (%s); reconnecting", self.topic, exc)
                    backend.close()
                    backend = None
                    self.reconnects += 1
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (the CLI's): a stop like any other, the manifest is whole
            log.warning("stream %s: interrupted; stopping", self.topic)
        finally:
            if backend is not None:
                backend.close()
        next_index = self.log.next_index()
        return StreamRun(
            topic=self.topic,
            manifest_path=str(self.log.path),
            produced=next_index - first,
            next_index=next_index,
            seconds=time.monotonic() - started,
            target_rate=rate,
            refilled=self.refilled,
            reconnects=self.reconnects,
        )

    # ---- sending -----------------------------------------------------------------------------------------

    def _append(self, backend: ProducerBackend, start: int, stop: int) -> None:
        """Send stream indices ``[start, stop)`` and append their segments once acknowledged."""
        segments = self._deliver(backend, np.arange(start, stop, dtype=np.int64))
        ends = self.log.end_offsets()
        for segment in segments:
            if segment.first_offset != ends[segment.partition]:
                # e.g. the broker restarted empty and auto-created the topic on the next produce
                raise BrokerError(
                    f"{self.topic}[{segment.partition}]: index {segment.first_index} landed at offset "
                    f"{segment.first_offset}, but the manifest continues at {ends[segment.partition]}"
                )
        self.log.append(segments)

    def _deliver(self, backend: ProducerBackend, indices: np.ndarray) -> list[Segment]:
        """Send ``indices`` (ascending), wait for every acknowledgement, return the segments they form."""
        ledger = DeliveryLedger(self.topic, self.partitions)
        images, labels = self._samples(indices)
        for index, value in zip(indices.tolist(), self.codec.encode(indices, images, labels), strict=True):
            backend.send(
                self.topic, index % self.partitions, str(index).encode("ascii"), value, ledger.callback(1, len(value))
            )
        backend.flush(self.ack_timeout_s, count_wire_bytes=False)
        produced_ms = int(time.time() * 1000)
        segments = []
        for part in ledger.partitions():
            mine = indices[indices % self.partitions == part.partition]
            if part.num_messages != len(mine):
                raise BrokerError(
                    f"{self.topic}[{part.partition}]: {part.num_messages} of {len(mine)} records acknowledged"
                )
            if len(mine):
                segments.append(
                    Segment(
                        part.partition, int(mine[0]), int(mine[-1]), part.first_offset, part.last_offset, produced_ms
                    )
                )
        return segments

    def _samples(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels of stream ``indices``: dataset record ``i % num_records``, from the chunk cache."""
        records = indices % self.source.num_records
        chunks = records // MAX_CHUNK
        images = np.empty((len(indices), *self.source.image_shape), dtype=self.source.record_dtype)
        labels = np.empty(len(indices), dtype=np.int64)
        for chunk in np.unique(chunks).tolist():
            chunk_images, chunk_labels = self._chunk(chunk)
            here = chunks == chunk
            images[here] = chunk_images[records[here] - chunk * MAX_CHUNK]
            labels[here] = chunk_labels[records[here] - chunk * MAX_CHUNK]
        return images, labels

    def _chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        # Generating a synthetic image costs ~0.5 ms, more than sending it: each dataset chunk is made once and
        # kept (the stream cycles through the dataset, so memory stays at the dataset's size).
        if chunk not in self._chunks:
            start = chunk * MAX_CHUNK
            stop = min(start + MAX_CHUNK, self.source.num_records)
            _, images, labels = next(self.source.batches(start, stop, stop - start))
            self._chunks[chunk] = (images, labels)
        return self._chunks[chunk]

    # ---- reconnecting ------------------------------------------------------------------------------------

    def _connect(self) -> ProducerBackend:
        """Wait for the broker, make the topic hold exactly the manifest again, return a fresh producer."""
        kcfg = self.cfg.kafka
        deadline = time.monotonic() + kcfg.request_timeout_s * 4
        while True:
            try:
                if not admin.topic_exists(kcfg, self.topic):
                    admin.create_topic(kcfg, self.topic, self.partitions)
                present = admin.topic_partitions(kcfg, self.topic)
                ends = offsets.exact_end_offsets(kcfg, self.topic)
                break
            except BrokerError as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("stream %s: waiting for the %s (%s)", self.topic, admin.describe_broker(kcfg), exc)
                time.sleep(0.5)
        backend = make_producer(kcfg, self.cfg.produce, self.cfg.produce.variant.compression)
        try:
            self._refill(backend, ends if len(present) == self.partitions else None)
        except BaseException:
            backend.close()
            raise
        return backend

    def _refill(self, backend: ProducerBackend, ends: dict[int, int] | None) -> None:
        """Produce the manifest again when the broker lost part of it (the memory-only broker loses everything on
        restart). A topic that is not empty is recreated first: what is left of it may be records in the wrong
        places (a restarted broker auto-creates the topic, with its default partition count, on the first
        produce), and a reader must not take them for the stream. ``ends`` is None when the partition count is
        wrong."""
        wanted = self.log.end_offsets()
        if ends is not None:
            ahead = {p: (ends[p], wanted[p]) for p in wanted if ends[p] > wanted[p]}
            if ahead:
                raise TopicError(
                    f"stream topic {self.topic!r} holds records its manifest {self.log.path} does not "
                    f"know (partition: broker end, manifest end): {ahead}; another producer wrote to it, or this one's "
                    "writes landed after it gave up waiting for their acknowledgement"
                )
            if ends == wanted:
                return
        empty = ends is not None and not any(ends.values())
        log.warning(
            "stream %s: the %s lost records (broker ends %s, manifest ends %s); %sproducing them again from %s",
            self.topic,
            admin.describe_broker(self.cfg.kafka),
            ends,
            wanted,
            "" if empty else "recreating the topic and ",
            self.log.path,
        )
        if not empty:  # an empty topic holds nothing misplaced, and recreating one crashes its readers (librdkafka)
            admin.delete_topic(self.cfg.kafka, self.topic)
            admin.create_topic(self.cfg.kafka, self.topic, self.partitions)
        stop = self.log.next_index()
        for start in range(0, stop, MAX_CHUNK):
            indices = np.arange(start, min(start + MAX_CHUNK, stop), dtype=np.int64)
            for segment in self._deliver(backend, indices):
                # The manifest holds index o * P + p at offset o of partition p (StreamLog.check).
                if segment.first_index != segment.first_offset * self.partitions + segment.partition:
                    raise TopicError(
                        f"refilling {self.topic}[{segment.partition}]: index {segment.first_index} "
                        f"landed at offset {segment.first_offset}"
                    )
            self.refilled += len(indices)
