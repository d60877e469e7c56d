"""Where a loader's batches are read, decoded and assembled: one class per way (``reader.mode`` and
``reader.workers``), each giving an epoch's batches in groups from a given batch on.

- :class:`StreamMode`: fetch (on a thread, ``reader.fetch_ahead_blocks`` ahead), decode and assemble on a second
  thread, at most ``reader.prefetch_batches`` ahead of the training loop.
- :class:`EagerMode`: the whole shard read and decoded before the first batch (the original's measurement, and the
  in-memory baseline).
- :class:`ProcessMode`: :class:`StreamMode`'s work in a child process with a consumer of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.assembly import BatchAssembler, LoaderStats
from kbit_core.data.batching import Batch
from kbit_core.data.pipeline import ChildProcess, threaded
from kbit_core.data.reader import RangeReader, ReaderStats
from kbit_core.data.schedule import ShardSchedule
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.sharding import OffsetRange

# The smallest fetch a loader's reader asks for, as measured (docs/data_plane_benchmark.md, a loader's fetch sized
# to its blocks); chosen when librdkafka refused fetches under its 1,000,000-byte message.max.bytes, which kbit's
# consumers now lower with the fetch (kafka.clients): a smaller floor is possible, not measured.
MIN_LOADER_FETCH_BYTES = 1024 * 1024


def loader_reader(cfg: KbitConfig, manifest: Manifest, client: ClientName | None, codec: Any = None) -> RangeReader:
    """A loader's reader of ``manifest``'s topic (``codec``: default ``reader.decoder``'s), fetching at most a
    quarter of a block's bytes at a time (at least :data:`MIN_LOADER_FETCH_BYTES`, at most ``reader.fetch_max_bytes``).
    A loader reads its blocks in shuffled order, and each jump to another block throws away what the client had
    fetched ahead, up to twice a fetch: at 16 MiB fetches and 3.3 MB blocks that was ten blocks' worth of fetching
    per block read (measured: the loader's process CPU per single-record message fell by about a third)."""
    block_bytes = cfg.shard.block_records * manifest.value_bytes // max(1, manifest.num_records)
    # a manifest without its bytes counted (0) keeps reader.fetch_max_bytes; so does reader.fetch: batches, whose
    # consumer sizes each Fetch to the records its ranges still need and has no prefetch queue to bound
    block_bytes = 0 if cfg.reader.fetch == "batches" else block_bytes
    fetch = min(cfg.reader.fetch_max_bytes, max(MIN_LOADER_FETCH_BYTES, block_bytes // 4)) if block_bytes else None
    reader_cfg = cfg.reader.model_copy(update={"fetch_max_bytes": fetch}) if fetch else cfg.reader
    codec = codec if codec is not None else manifest_codec(manifest, cfg.reader.decoder, cfg.registry)
    return RangeReader(cfg.kafka, reader_cfg, manifest.topic, codec, client)


def groups_ahead(schedule: ShardSchedule) -> int:
    """``reader.prefetch_batches`` in groups, rounded up to whole blocks."""
    return -(-schedule.cfg.reader.prefetch_batches // max(1, schedule.cfg.shard.block_records // schedule.batch_size))


class StreamMode:
    """Batches streamed from Kafka: fetch, decode and assembly overlap the training loop."""

    def __init__(self, schedule: ShardSchedule, reader: RangeReader, assembler: BatchAssembler) -> None:
        self.schedule, self.reader, self.assembler = schedule, reader, assembler

    def groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        """:meth:`assembled` on a thread into a queue of ``reader.prefetch_batches`` batches, rounded up to whole
        blocks; an exception there is re-raised here."""
        s = self.schedule
        return threaded(self.assembled(skip_batches), groups_ahead(s), f"kbit-loader-r{s.rank}-{s.split}")

    def assembled(self, skip_batches: int) -> Iterator[list[Batch]]:
        """The epoch's batches from ``skip_batches`` on, in groups (see :meth:`BatchAssembler.groups`), on the
        calling thread (the fetch on a thread of its own when ``reader.fetch_ahead_blocks`` is set)."""
        blocks, skip_records = self.schedule.blocks(skip_batches)
        by_range = {b.range: b for b in blocks}
        ranges = [b.range for b in blocks]
        ahead = self.schedule.cfg.reader.fetch_ahead_blocks
        s = self.schedule
        fetched = (
            threaded(self.reader.read_raw(ranges), ahead, f"kbit-loader-fetch-r{s.rank}-{s.split}")
            if ahead
            else self.reader.read_raw(ranges)
        )
        decoded = ((by_range[r], batch) for r, batch in self.reader.decode_ranges(fetched))
        return self.assembler.groups(decoded, skip_batches, skip_records)

    def close(self) -> None:
        """Nothing to release: each epoch's threads end with its iteration."""


class EagerMode:
    """The whole shard read and decoded once (again only when the epoch's shard changes), then cut into batches."""

    def __init__(
        self, schedule: ShardSchedule, reader: RangeReader, assembler: BatchAssembler, stats: LoaderStats
    ) -> None:
        self.schedule, self.reader, self.assembler, self.stats = schedule, reader, assembler, stats
        self._decoded: dict[OffsetRange, Any] | None = None
        self._ranges: tuple[OffsetRange, ...] = ()

    def load(self) -> dict[OffsetRange, Any]:
        """Read and decode the whole shard (or the pieces a resharded epoch reads), once per set of ranges."""
        unique = tuple(sorted({b.range for b in self.schedule.blocks_in_offset_order()}))
        if self._decoded is None or self._ranges != unique:
            t0 = time.perf_counter()
            self._decoded = dict(self.reader.read(unique))
            self._ranges = unique
            self.stats.load_seconds += time.perf_counter() - t0
        return self._decoded

    def groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        blocks, skip_records = self.schedule.blocks(skip_batches)
        decoded = self.load()
        in_order = ((b, decoded[b.range]) for b in blocks if b.range in decoded)
        return self.assembler.groups(in_order, skip_batches, skip_records)

    def close(self) -> None:
        self._decoded = None


class ProcessMode:
    """:class:`StreamMode` in this loader's child process (``reader.workers: process``), which reads with a consumer
    of its own; the child's counts (skipped, gaps, retries, padded, ...) are added to ``stats`` as its groups arrive.
    The child starts at the first epoch and ends with :meth:`close`."""

    def __init__(self, schedule: ShardSchedule, client: ClientName, stats: LoaderStats, pin_memory: bool) -> None:
        self.schedule, self.client, self.stats, self.pin_memory = schedule, client, stats, pin_memory
        self._worker: ChildProcess[tuple[int, int], tuple[list[Batch], _WorkerCounts]] | None = None
        self._seen = _WorkerCounts()  # the worker's counts so far, already added to stats

    def groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        s = self.schedule
        if self._worker is None:
            shard = _WorkerShard(s.cfg, s.manifest, s.split, s.rank, s.world_size, self.client)
            self._worker = ChildProcess(shard, groups_ahead(s), pin_memory=self.pin_memory)
        with contextlib.closing(self._worker.run((s.epoch, skip_batches))) as items:
            for group, counts in items:
                for name, value in dataclasses.asdict(counts.reader).items():
                    before = getattr(self._seen.reader, name)
                    setattr(self.stats.reader, name, getattr(self.stats.reader, name) + value - before)
                self.stats.padded_records += counts.padded_records - self._seen.padded_records
                self._seen = counts
                if group:
                    yield group

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker, self._seen = None, _WorkerCounts()


@dataclass
class _WorkerCounts:
    reader: ReaderStats = field(default_factory=ReaderStats)
    padded_records: int = 0


class _WorkerShard:
    """A loader's shard in its worker process: for each ``(epoch, skip_batches)``, that epoch's groups from there,
    each with the counts so far. The worker's reader (and its consumer) lives as long as the process."""

    def __init__(
        self, cfg: KbitConfig, manifest: Manifest, split: str, rank: int, world_size: int, client: ClientName
    ) -> None:
        self.cfg, self.manifest, self.split, self.rank, self.world_size = cfg, manifest, split, rank, world_size
        self.client = client
        self._stream: StreamMode | None = None
        self._stats = LoaderStats()

    def __call__(self, request: tuple[int, int]) -> Iterator[tuple[list[Batch], _WorkerCounts]]:
        epoch, skip_batches = request
        if self._stream is None:
            cfg, manifest = self.cfg, self.manifest
            schedule = ShardSchedule(cfg, manifest, self.split, self.rank, self.world_size, epoch)
            reader = loader_reader(cfg, manifest, self.client)
            self._stats = LoaderStats(reader=reader.stats)
            # pin_memory off: the child never touches CUDA (the rank pins what arrives)
            self._stream = StreamMode(schedule, reader, BatchAssembler(schedule, self._stats, pin_memory=False))
        stream, stats = self._stream, self._stats
        if stream.schedule.epoch != epoch:
            stream.schedule.set_plan(epoch)

        def counts() -> _WorkerCounts:
            return _WorkerCounts(dataclasses.replace(stats.reader), stats.padded_records)

        for group in stream.assembled(skip_batches):
            yield group, counts()
        yield [], counts()  # what the last blocks counted after the last group (skipped, gaps)
