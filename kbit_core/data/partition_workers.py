"""``reader.workers: partitions``: a loader's blocks fetched and decoded in parallel by worker processes, one per
partition (or per group of partitions, ``reader.partition_workers``), into shared memory; the rank cuts the batches.

Each worker keeps a consumer of its own across epochs and, per epoch, is sent the loader's blocks of its partitions in
the loader's order. It fetches them (``reader.fetch_ahead_blocks`` ahead, on a thread), decodes each and takes its rows
in the block's permuted order straight into fresh shared-memory tensors: only those buffers, and the worker's counts,
cross to the rank (no pickled record or value). The rank takes the blocks
back in the loader's order (each worker's blocks arrive in that order), so batches, their order, the resume state and
the counts are the thread mode's. A corrupt record fails in the rank with its coordinates (the worker's error, its
traceback as a note); a worker that dies is a one-line error naming it and its partitions.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.assembly import BatchAssembler, LoaderStats
from kbit_core.data.batching import Batch
from kbit_core.data.loader_modes import groups_ahead
from kbit_core.data.pipeline import ChildProcess, threaded
from kbit_core.data.reader import RangeReader, ReaderStats
from kbit_core.data.schedule import ShardSchedule
from kbit_core.errors import KbitError
from kbit_core.formats.base import DecodedBatch
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.sharding import Block

# Blocks a worker holds ready beyond the one the rank is taking (its shared memory is bounded by this).
BLOCKS_AHEAD = 2

_WorkerItem = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, ReaderStats]


def worker_of(partition: int, workers: int) -> int:
    """The worker that reads ``partition`` (the same in every epoch, so each partition's consumer stays one)."""
    return partition % workers


class PartitionMode:
    """The loader's blocks from one worker process per partition group, assembled into batches on a thread of the
    rank (at most ``reader.prefetch_batches`` ahead, in groups as :class:`StreamMode` hands them over). The workers
    start with the first epoch that gives them blocks and end with :meth:`close`."""

    def __init__(
        self, schedule: ShardSchedule, client: ClientName, stats: LoaderStats, assembler: BatchAssembler
    ) -> None:
        self.schedule, self.client, self.stats, self.assembler = schedule, client, stats, assembler
        partitions = len(schedule.manifest.partitions)
        self.workers = min(schedule.cfg.reader.partition_workers or partitions, partitions)
        self._children: dict[int, ChildProcess[list[Block], _WorkerItem]] = {}
        self._seen: dict[int, ReaderStats] = {}  # each worker's counts so far, already added to stats

    def groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        s = self.schedule
        return threaded(self._assembled(skip_batches), groups_ahead(s), f"kbit-loader-r{s.rank}-{s.split}")

    def _assembled(self, skip_batches: int) -> Iterator[list[Batch]]:
        blocks, skip_records = self.schedule.blocks(skip_batches)
        blocks = [b for b in blocks if len(b.range)]  # the reader yields nothing for an empty range
        return self.assembler.groups(self._decoded(blocks), skip_batches, skip_records)

    def _decoded(self, blocks: list[Block]) -> Iterator[tuple[Block, DecodedBatch]]:
        """Each block with its decoded, permuted arrays, in the loader's order, from the worker of its partition."""
        mine: dict[int, list[Block]] = {}
        for block in blocks:
            mine.setdefault(worker_of(block.range.partition, self.workers), []).append(block)
        with contextlib.ExitStack() as runs:
            items = {w: runs.enter_context(contextlib.closing(self._child(w).run(b))) for w, b in mine.items()}
            for block in blocks:
                w = worker_of(block.range.partition, self.workers)
                arrays, counts = next(items[w])
                self._count(w, counts)
                if arrays is not None:
                    yield block, DecodedBatch(*(a.numpy() for a in arrays))
            for w, rest in items.items():  # each run ends after its last block: have its worker say so
                if next(rest, None) is not None:
                    raise KbitError(f"{self._child(w).name} sent more blocks than it was asked for")

    def _child(self, w: int) -> ChildProcess[list[Block], _WorkerItem]:
        if w not in self._children:
            s = self.schedule
            parts = [p.partition for p in s.manifest.partitions if worker_of(p.partition, self.workers) == w]
            name = (
                f"loader worker process {w} of rank {s.rank} split {s.split} "
                f"(partitions {', '.join(map(str, parts))} of topic {s.manifest.topic})"
            )
            source = _PartitionReader(s.cfg, s.manifest, self.client)
            self._children[w] = ChildProcess(source, BLOCKS_AHEAD, name=name)
            self._seen[w] = ReaderStats()
        return self._children[w]

    def _count(self, w: int, counts: ReaderStats) -> None:
        """Add what worker ``w`` counted since its last item to the loader's reader counts."""
        before = self._seen[w]
        for name, value in dataclasses.asdict(counts).items():
            setattr(self.stats.reader, name, getattr(self.stats.reader, name) + value - getattr(before, name))
        self._seen[w] = counts

    def close(self) -> None:
        children, self._children, self._seen = self._children, {}, {}
        for child in children.values():
            child.close()


class _PartitionReader:
    """A worker's reader: for each request (blocks, in the loader's order), one item per block: its arrays in
    shared memory (None when every record was skipped as corrupt), and the worker's counts so far."""

    def __init__(self, cfg: KbitConfig, manifest: Manifest, client: ClientName) -> None:
        self.cfg, self.manifest, self.client = cfg, manifest, client
        self._reader: RangeReader | None = None

    def __call__(self, blocks: list[Block]) -> Iterator[_WorkerItem]:
        if self._reader is None:
            codec = manifest_codec(self.manifest, self.cfg.reader.decoder, self.cfg.registry)
            self._reader = RangeReader(self.cfg.kafka, self.cfg.reader, self.manifest.topic, codec, self.client)
        reader, ahead = self._reader, self.cfg.reader.fetch_ahead_blocks
        ranges = [b.range for b in blocks]
        fetched = threaded(reader.read_raw(ranges), ahead, "kbit-partition-fetch") if ahead else reader.read_raw(ranges)
        with contextlib.closing(fetched):  # type: ignore[type-var]
            for block, (_, records) in zip(blocks, fetched):
                batch = reader.decode(records)
                yield (None if batch is None else _shared(block, batch)), dataclasses.replace(reader.stats)


def _shared(block: Block, batch: DecodedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch``'s indices, labels and pixels in ``block``'s order, each taken straight into a fresh shared-memory
    tensor (pixels as decoded: uint8 crosses a quarter of float32's bytes, and the rank's division releases the GIL)."""
    perm = block.permutation(len(batch.labels))
    return _taken(batch.indices, perm), _taken(batch.labels, perm), _taken(batch.pixels, perm)


def _taken(column: np.ndarray, perm: np.ndarray) -> torch.Tensor:
    dtype = torch.from_numpy(column[:0]).dtype
    out = torch.empty((len(perm), *column.shape[1:]), dtype=dtype).share_memory_()
    np.take(column, perm, axis=0, out=out.numpy())
    return out
