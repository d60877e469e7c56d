"""``reader.workers: partitions``: a loader's blocks fetched and decoded in parallel by worker processes, one per
partition (or per group of partitions, ``reader.partition_workers``), into shared memory; the rank cuts the batches.

Each worker keeps a consumer of its own across epochs and splits: the workers of a topic are one
:class:`PartitionWorkers` per process (a rank), shared by its loaders of every split, so their start-up (the forkserver
importing torch, a fork and a consumer per worker) is paid once per rank. Per epoch a worker is sent the loader's blocks
of its partitions in the loader's order. It fetches them (``reader.fetch_ahead_blocks`` ahead, on a thread), decodes each and takes its rows
in the block's permuted order straight into fresh shared-memory tensors: only those buffers, and the worker's counts,
cross to the rank (no pickled record or value). The rank takes the blocks
back in the loader's order (each worker's blocks arrive in that order), so batches, their order, the resume state and
the counts are the thread mode's. A corrupt record fails in the rank with its coordinates (the worker's error, its
traceback as a note); a worker that dies is a one-line error naming it and its partitions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import torch

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.assembly import BatchAssembler, LoaderStats
from kbit_core.data.batching import Batch
from kbit_core.data.loader_modes import groups_ahead, loader_reader
from kbit_core.data.pipeline import ChildProcess, threaded
from kbit_core.data.reader import RangeReader, ReaderStats
from kbit_core.data.schedule import ShardSchedule
from kbit_core.errors import KbitError
from kbit_core.formats.base import DecodedBatch
from kbit_core.kafka.manifest import Manifest
from kbit_core.sharding import Block

# Blocks a worker holds ready beyond the one the rank is taking (its shared memory is bounded by this).
BLOCKS_AHEAD = 2

_WorkerItem = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, ReaderStats]


def worker_of(partition: int, workers: int) -> int:
    """The worker that reads ``partition`` (the same in every epoch, so each partition's consumer stays one)."""
    return partition % workers


class PartitionMode:
    """The loader's blocks from the rank's :class:`PartitionWorkers` of its topic, assembled into batches on a thread of
    the rank (at most ``reader.prefetch_batches`` ahead, in groups as :class:`StreamMode` hands them over). The loader
    joins the workers with its first epoch and leaves them with :meth:`close` (the last loader to leave ends them)."""

    def __init__(
        self, schedule: ShardSchedule, client: ClientName, stats: LoaderStats, assembler: BatchAssembler
    ) -> None:
        self.schedule, self.client, self.stats, self.assembler = schedule, client, stats, assembler
        self._workers: PartitionWorkers | None = None

    def groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        s = self.schedule
        if self._workers is None:
            self._workers = PartitionWorkers.join(s.cfg, s.manifest, self.client)
        assembled = self._assembled(self._workers, skip_batches)
        return threaded(assembled, groups_ahead(s), f"kbit-loader-r{s.rank}-{s.split}")

    def _assembled(self, workers: PartitionWorkers, skip_batches: int) -> Iterator[list[Batch]]:
        blocks, skip_records = self.schedule.blocks(skip_batches)
        blocks = [b for b in blocks if len(b.range)]  # the reader yields nothing for an empty range
        return self.assembler.groups(self._decoded(workers, blocks), skip_batches, skip_records)

    def _decoded(self, workers: PartitionWorkers, blocks: list[Block]) -> Iterator[tuple[Block, DecodedBatch]]:
        """Each block with its decoded, permuted arrays, in the loader's order, from the worker of its partition."""
        s = self.schedule
        mine: dict[int, list[Block]] = {}
        for block in blocks:
            mine.setdefault(workers.worker_of(block.range.partition), []).append(block)
        with contextlib.ExitStack() as runs:
            children = {w: runs.enter_context(workers.borrowed(w, s.rank, s.split)) for w in mine}
            items = {w: runs.enter_context(contextlib.closing(children[w].run(b))) for w, b in mine.items()}
            for block in blocks:
                w = workers.worker_of(block.range.partition)
                arrays, counts = next(items[w])
                self._count(workers.counted(children[w], counts))
                if arrays is not None:
                    yield block, DecodedBatch(*(a.numpy() for a in arrays))
            for w, rest in items.items():  # each run ends after its last block: have its worker say so
                if next(rest, None) is not None:
                    raise KbitError(f"{children[w].name} sent more blocks than it was asked for")

    def _count(self, since: dict[str, int | float]) -> None:
        """Add what a worker counted since its last item to the loader's reader counts."""
        for name, value in since.items():
            setattr(self.stats.reader, name, getattr(self.stats.reader, name) + value)

    def close(self) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.leave()


class PartitionWorkers:
    """One process's worker processes of one topic (one per partition group, each with its consumer), shared by the
    loaders that joined them (a rank's splits, over its epochs). A run borrows a worker; one that another loader is
    iterating at the same time gets a worker of its own for the run (kept idle for the next). The last loader to
    leave ends them all."""

    _shared: dict[tuple[str, ...], PartitionWorkers] = {}
    _shared_lock = threading.Lock()

    def __init__(self, key: tuple[str, ...], cfg: KbitConfig, manifest: Manifest, client: ClientName) -> None:
        self.key, self.cfg, self.manifest, self.client = key, cfg, manifest, client
        partitions = len(manifest.partitions)
        self.workers = min(cfg.reader.partition_workers or partitions, partitions)
        self.loaders = 0
        self._idle: dict[int, list[ChildProcess[list[Block], _WorkerItem]]] = {}
        self._seen: dict[ChildProcess[list[Block], _WorkerItem], ReaderStats] = {}  # each worker's counts so far
        self._lock = threading.Lock()

    @classmethod
    def join(cls, cfg: KbitConfig, manifest: Manifest, client: ClientName) -> PartitionWorkers:
        """This process's workers of ``manifest``'s topic read with ``client`` and these settings, joined."""
        key = (
            manifest.model_dump_json(),
            client,
            *(c.model_dump_json() for c in (cfg.kafka, cfg.reader, cfg.registry)),
        )
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(key, cfg, manifest, client)
            workers = cls._shared[key]
            workers.loaders += 1
            return workers

    def leave(self) -> None:
        with self._shared_lock:
            self.loaders -= 1
            if self.loaders:
                return
            del self._shared[self.key]
        with self._lock:
            children, self._idle, self._seen = list(self._seen), {}, {}
        for child in children:
            child.close()

    def worker_of(self, partition: int) -> int:
        return worker_of(partition, self.workers)

    @contextlib.contextmanager
    def borrowed(self, w: int, rank: int, split: str) -> Iterator[ChildProcess[list[Block], _WorkerItem]]:
        """Worker ``w`` (an idle one, or a new one), named for the loader of ``split`` of ``rank`` while it runs."""
        with self._lock:
            idle = self._idle.setdefault(w, [])
            child = idle.pop() if idle else None
        parts = [p.partition for p in self.manifest.partitions if self.worker_of(p.partition) == w]
        name = (
            f"loader worker process {w} of rank {rank} split {split} "
            f"(partitions {', '.join(map(str, parts))} of topic {self.manifest.topic})"
        )
        if child is None:
            child = ChildProcess(_PartitionReader(self.cfg, self.manifest, self.client), BLOCKS_AHEAD, name=name)
            with self._lock:
                self._seen[child] = ReaderStats()
        child.name = name
        failed = True
        try:
            yield child
            failed = False
        except GeneratorExit:  # its loader stopped early: the next run resets it
            failed = False
            raise
        finally:
            if failed:  # it raised (or died): never lent again
                with self._lock:
                    self._seen.pop(child, None)
                child.close()
            else:
                with self._lock:
                    self._idle[w].append(child)

    def counted(self, child: ChildProcess[list[Block], _WorkerItem], counts: ReaderStats) -> dict[str, int | float]:
        """What ``child`` counted since its last item (``counts``: its counts so far), by name."""
        with self._lock:
            before, self._seen[child] = self._seen[child], counts
        return {name: value - getattr(before, name) for name, value in dataclasses.asdict(counts).items()}


class _PartitionReader:
    """A worker's reader: for each request (blocks, in the loader's order), one item per block: its arrays in
    shared memory (None when every record was skipped as corrupt), and the worker's counts so far."""

    def __init__(self, cfg: KbitConfig, manifest: Manifest, client: ClientName) -> None:
        self.cfg, self.manifest, self.client = cfg, manifest, client
        self._reader: RangeReader | None = None

    def __call__(self, blocks: list[Block]) -> Iterator[_WorkerItem]:
        if self._reader is None:
            self._reader = loader_reader(self.cfg, self.manifest, self.client)
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
