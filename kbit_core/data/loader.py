"""ShardLoader: one rank's batches of one split, streamed from Kafka through a bounded queue or loaded eagerly.

Every rank of a split yields exactly ``len(loader)`` batches (computed from the plan, never from what
happened to arrive), so DDP collectives never wait on a rank that ran out of data. Batches are
``(x float32 [B, C, H, W] in [0, 1], y int64 [B])``; the train split is block-shuffled per epoch
(``sharding.block_order``), val and test keep offset order. ``stream`` and ``eager`` yield identical
batches: eager only moves the reading in front of the first batch (the original's measurement, and the
in-memory baseline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.batching import Batch, Rows, to_batch
from kbit_core.data.pipeline import ChildProcess, threaded
from kbit_core.data.reader import RangeReader, ReaderStats
from kbit_core.errors import ConfigError, KbitError
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.sharding import Block, OffsetRange, Plan, RankShard, block_order, plan

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class LoaderStats:
    batches: int = 0
    records: int = 0
    padded_records: int = 0  # repeated to keep len() after corrupt records were skipped
    left_out_records: int = 0  # read from this rank's shard but not yielded: see ShardLoader.left_out_records
    wait_seconds: float = 0.0  # time the consumer spent blocked waiting for a batch (data-wait)
    load_seconds: float = 0.0  # eager mode: reading and decoding the whole shard
    reader: ReaderStats = field(default_factory=ReaderStats)  # shared by every loader of a shared reader


def per_rank_batch_size(global_batch_size: int, world_size: int) -> int:
    """``global // world``; ConfigError when that is 0, a warning when it does not divide (the original
    truncated silently, training on a smaller global batch than configured)."""
    size = global_batch_size // world_size
    if size == 0:
        raise ConfigError(f"train.global_batch_size={global_batch_size} gives 0 samples per rank on {world_size} ranks")
    if global_batch_size % world_size:
        log.warning(
            "train.global_batch_size=%d does not divide by %d ranks: %d per rank, %d globally",
            global_batch_size,
            world_size,
            size,
            size * world_size,
        )
    return size


class ShardLoader:
    """Iterable of ``(x, y)`` batches of ``split`` for ``rank``; see the module docstring.

    Without ``reader`` the loader opens (and closes) a reader of its own; with one, it reads through that
    shared reader and leaves closing it to its owner. ``pin_memory`` (default: ``launch.use_gpu`` where CUDA is
    available) page-locks the batches for asynchronous copies to the GPU.
    """

    def __init__(
        self,
        cfg: KbitConfig,
        manifest: Manifest,
        split: str,
        rank: int,
        world_size: int,
        codec: Any,
        *,
        epoch: int = 0,
        client: ClientName | None = None,
        reader: RangeReader | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.cfg, self.manifest, self.split = cfg, manifest, split
        self.rank, self.world_size, self.codec = rank, world_size, codec
        self.batch_size = per_rank_batch_size(cfg.train.global_batch_size, world_size)
        self.mode = cfg.reader.mode
        self.pin_memory = cfg.launch.use_gpu and torch.cuda.is_available() if pin_memory is None else pin_memory
        self.shuffle = split == "train" and cfg.shard.shuffle
        self._rpm = manifest.variant.records_per_message
        # Only the dataset's last message can hold fewer records; counting it against every rank keeps
        # len() identical on all of them.
        self._short = manifest.num_messages * self._rpm - manifest.num_records
        self._owns_reader = reader is None
        self.reader = reader or RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, client)
        self.stats = LoaderStats(reader=self.reader.stats)
        self._eager: dict[OffsetRange, Any] | None = None
        self._eager_ranges: tuple[OffsetRange, ...] = ()
        self.batches_done = 0
        self._resume_at = 0
        self._worker: ChildProcess[tuple[int, int], tuple[list[Batch], _WorkerCounts]] | None = None
        self._worker_counts = _WorkerCounts()  # the worker's counts so far, already added to self.stats
        self._set_plan(epoch)

    # -- plan and length -----------------------------------------------------------------------------

    def _make_plan(self, epoch: int) -> Plan:
        try:
            return plan(
                self.manifest.ranges(),
                self.cfg.shard.split_rates,
                self.world_size,
                epoch=epoch,
                seed=self.cfg.shard.seed,
                remainder=self.cfg.shard.remainder,
                records_per_message=self._rpm,
            )
        except ValueError as exc:
            raise ConfigError(f"cannot plan shards of topic {self.manifest.topic!r}: {exc}") from None

    def _plan_hash(self, p: Plan) -> str:
        return hashlib.sha256(f"{self.manifest.topic}|{p.fingerprint()}".encode()).hexdigest()[:16]

    def _set_plan(self, epoch: int) -> None:
        self.epoch = epoch
        self.plan = self._make_plan(epoch)
        try:
            self.shard: RankShard = self.plan.shard(self.split, self.rank)
        except ValueError as exc:
            raise ConfigError(
                f"topic {self.manifest.topic!r} with shard.split_rates={self.cfg.shard.split_rates}: {exc}"
            ) from None

    @property
    def num_records(self) -> int:
        """Records every rank yields per epoch (train: whole batches only)."""
        return self._available - self.tail_records

    @property
    def tail_records(self) -> int:
        """Train records past the last whole batch, left out each epoch (which ones changes with the shuffle)."""
        return self._available % self.batch_size if self.split == "train" else 0

    @property
    def _available(self) -> int:
        return max(0, self.shard.num_records - self._short)

    @property
    def left_out_records(self) -> int:
        """Records of this rank's shard an epoch does not yield: the train split's partial last batch, and, with
        several records per message, the records past what the rank holding the dataset's short last message
        can yield (every rank yields that many, so len() is equal on all of them)."""
        held = self.shard.num_records - (self._short if self._holds_short_message else 0)
        return held - self.num_records

    @property
    def _holds_short_message(self) -> bool:
        if not self._short:
            return False
        # message i went to partition i % P, in order: the last one is the last offset of partition (N - 1) % P
        parts = self.manifest.partitions
        last = next(p for p in parts if p.partition == (self.manifest.num_messages - 1) % len(parts))
        return any(r.partition == last.partition and r.start <= last.last_offset < r.stop for r in self.shard.ranges)

    def __len__(self) -> int:
        return -(-self.num_records // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch; calling it with the epoch being resumed keeps the resume point."""
        if epoch == self.epoch and self._resume_at:
            return
        self._set_plan(epoch)
        self.batches_done = self._resume_at = 0

    # -- resume ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.cfg.shard.seed,
            "world_size": self.world_size,
            "plan_hash": self._plan_hash(self.plan),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the first batch not yet seen in ``state['epoch']``; the plan must be the same."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["world_size"] != self.world_size:
            raise ConfigError(
                f"the loader state was saved with world size {state['world_size']}, this run has "
                f"{self.world_size}; resuming mid-epoch needs the same world size"
            )
        resumed = self._make_plan(state["epoch"])
        if state["seed"] != self.cfg.shard.seed or state["plan_hash"] != self._plan_hash(resumed):
            raise ConfigError(
                f"the shard plan changed since the loader state was saved (plan {state['plan_hash']} "
                f"seed {state['seed']}, now {self._plan_hash(resumed)} seed {self.cfg.shard.seed}): "
                f"topic, split rates, remainder or seed differ"
            )
        self._set_plan(state["epoch"])
        self.batches_done = self._resume_at = int(state["batches_done"])

    # -- iteration -----------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.iter_indexed():
            yield batch.x, batch.y

    def iter_indexed(self) -> Iterator[Batch]:
        """Like iterating the loader, with each batch's dataset sample indices."""
        skip_batches, self._resume_at = self._resume_at, 0
        self.batches_done = skip_batches
        if self.mode == "eager":
            groups = self._timed(self._groups(skip_batches))
        elif self.cfg.reader.workers == "process":
            groups = self._timed(self._from_worker_process(skip_batches))
        else:
            groups = self._prefetched(self._groups(skip_batches))
        for group in groups:
            for batch in group:
                self.batches_done += 1
                self.stats.batches += 1
                self.stats.records += len(batch.y)
                yield batch
        left_out = self.left_out_records
        self.stats.left_out_records += left_out
        if left_out > self.tail_records:
            log.info(
                "rank %d split %s epoch %d: %d records of this rank's shard left out (%d past the last whole "
                "batch, %d to yield as many as the rank holding the dataset's short last message)",
                self.rank,
                self.split,
                self.epoch,
                left_out,
                self.tail_records,
                left_out - self.tail_records,
            )

    def _groups(self, skip_batches: int) -> Iterator[list[Batch]]:
        """This epoch's batches from the first one not yet seen, in groups (see :meth:`_assemble`)."""
        blocks = block_order(
            self.shard,
            self.cfg.shard.seed,
            self.epoch,
            max(1, self.cfg.shard.block_records // self._rpm),
            shuffle=self.shuffle,
        )
        skip_records = skip_batches * self.batch_size
        if self._rpm == 1:  # block sizes are exact: resume without reading the blocks already consumed
            while blocks and len(blocks[0].range) <= skip_records:
                skip_records -= len(blocks.pop(0).range)
        return self._assemble(self._decoded(blocks), skip_batches, skip_records)

    def _decoded(self, blocks: list[Block]) -> Iterator[tuple[Block, Any]]:
        if self.mode == "eager":
            cache = self.load()
            return ((b, cache[b.range]) for b in blocks if b.range in cache)
        by_range = {b.range: b for b in blocks}
        ranges = [b.range for b in blocks]
        ahead = self.cfg.reader.fetch_ahead_blocks
        fetched = (
            threaded(self.reader.read_raw(ranges), ahead, f"kbit-loader-fetch-r{self.rank}-{self.split}")
            if ahead
            else self.reader.read_raw(ranges)
        )
        return ((by_range[r], decoded) for r, decoded in self.reader.decode_ranges(fetched))

    def load(self) -> dict[OffsetRange, Any]:
        """Eager mode: read and decode the whole shard once (again only when the epoch's shard changes)."""
        if self._eager is None or self._eager_ranges != self.shard.ranges:
            t0 = time.perf_counter()
            blocks = block_order(self.shard, 0, 0, max(1, self.cfg.shard.block_records // self._rpm), shuffle=False)
            unique = sorted({b.range for b in blocks})
            self._eager = dict(self.reader.read(unique))
            self._eager_ranges = self.shard.ranges
            self.stats.load_seconds += time.perf_counter() - t0
        return self._eager

    def _assemble(
        self, decoded: Iterator[tuple[Block, Any]], skip_batches: int, skip_records: int
    ) -> Iterator[list[Batch]]:
        """Permute each block's samples and cut exact batches, yielded per block; pad from the last batch if the
        data ran short. Whole groups cross the prefetch queue: one hand-off per batch would cost a GIL switch
        interval (5 ms) each while the worker thread decodes (measured: 12k instead of 150k records/s)."""
        rows, total = Rows(), len(self)
        sizes = [self.batch_size] * total
        if total:
            sizes[-1] = self.num_records - (total - 1) * self.batch_size
        emitted, last = skip_batches, None
        for block, batch in decoded:
            if emitted >= total:
                break
            perm = block.permutation(len(batch.labels))
            pixels, labels, indices = batch.pixels[perm], batch.labels[perm], batch.indices[perm]
            if skip_records:
                k = min(skip_records, len(labels))
                pixels, labels, indices, skip_records = pixels[k:], labels[k:], indices[k:], skip_records - k
            rows.push(pixels, labels, indices)
            group = []
            while emitted < total and rows.size >= sizes[emitted]:
                last = rows.take(sizes[emitted])
                emitted += 1
                group.append(to_batch(*last, self.pin_memory))
            if group:
                yield group
        group = []
        for size in sizes[emitted:]:
            last = self._padded(rows, last, size)
            group.append(to_batch(*last, self.pin_memory))
        if group:
            yield group

    def _padded(self, rows: Rows, last: tuple[np.ndarray, ...] | None, size: int) -> tuple[np.ndarray, ...]:
        have = rows.take(rows.size) if rows.size else None
        source = have if have is not None else last
        if source is None:
            raise KbitError(
                f"rank {self.rank} has no readable record in split {self.split!r} of topic "
                f"{self.manifest.topic!r} (all skipped as corrupt?) but must yield {len(self)} batches"
            )
        missing = size - (len(have[1]) if have is not None else 0)
        reuse = np.arange(missing) % len(source[1])
        filler = tuple(col[reuse] for col in source)
        self.stats.padded_records += missing
        log.warning(
            "rank %d split %s: %d records short of len()=%d batches (skipped records?); repeating %d",
            self.rank,
            self.split,
            missing,
            len(self),
            missing,
        )
        return filler if have is None else tuple(np.concatenate([a, b]) for a, b in zip(have, filler))

    def _timed(self, groups: Iterator[list[Batch]]) -> Iterator[list[Batch]]:
        """``groups`` with the time spent waiting for each counted as data-wait; closing it closes ``groups``."""
        with contextlib.closing(groups):  # type: ignore[type-var]
            while True:
                t0 = time.perf_counter()
                group = next(groups, None)
                self.stats.wait_seconds += time.perf_counter() - t0
                if group is None:
                    return
                yield group

    def _prefetched(self, groups: Iterator[list[Batch]]) -> Iterator[list[Batch]]:
        """Run ``groups`` on a worker thread into a queue of ``reader.prefetch_batches`` batches, rounded up to
        whole blocks; a worker exception is re-raised here."""
        return self._timed(threaded(groups, self._groups_ahead, f"kbit-loader-r{self.rank}-{self.split}"))

    @property
    def _groups_ahead(self) -> int:
        """``reader.prefetch_batches`` in groups, rounded up to whole blocks."""
        return -(-self.cfg.reader.prefetch_batches // max(1, self.cfg.shard.block_records // self.batch_size))

    def _from_worker_process(self, skip_batches: int) -> Iterator[list[Batch]]:
        """:meth:`_groups` run in this loader's child process, which reads with a consumer of its own
        (``reader.workers: process``); its counts (skipped, gaps, retries, padded, ...) are added to this loader's
        as its groups arrive."""
        if self._worker is None:
            shard = _WorkerShard(self.cfg, self.manifest, self.split, self.rank, self.world_size, self.reader.client)
            self._worker = ChildProcess(shard, self._groups_ahead, pin_memory=self.pin_memory)
        with contextlib.closing(self._worker.run((self.epoch, skip_batches))) as items:
            for group, counts in items:
                seen = self._worker_counts
                for name, value in dataclasses.asdict(counts.reader).items():
                    before = getattr(seen.reader, name)
                    setattr(self.stats.reader, name, getattr(self.stats.reader, name) + value - before)
                self.stats.padded_records += counts.padded_records - seen.padded_records
                self._worker_counts = counts
                if group:
                    yield group

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker, self._worker_counts = None, _WorkerCounts()
        if self._owns_reader:
            self.reader.close()
        self._eager = None

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _WorkerCounts:
    reader: ReaderStats = field(default_factory=ReaderStats)
    padded_records: int = 0


class _WorkerShard:
    """A loader's shard in its worker process: for each ``(epoch, skip_batches)``, that epoch's groups from there,
    each with the counts so far. The worker's loader (and its consumer) lives as long as the process."""

    def __init__(
        self, cfg: KbitConfig, manifest: Manifest, split: str, rank: int, world_size: int, client: ClientName
    ) -> None:
        self.cfg, self.manifest, self.split, self.rank, self.world_size = cfg, manifest, split, rank, world_size
        self.client = client
        self._loader: ShardLoader | None = None

    def __call__(self, request: tuple[int, int]) -> Iterator[tuple[list[Batch], _WorkerCounts]]:
        epoch, skip_batches = request
        if self._loader is None:
            # pin_memory off: the child never touches CUDA (the rank pins what arrives)
            self._loader = ShardLoader(
                self.cfg,
                self.manifest,
                self.split,
                self.rank,
                self.world_size,
                manifest_codec(self.manifest, self.cfg.reader.decoder),
                epoch=epoch,
                client=self.client,
                pin_memory=False,
            )
        loader = self._loader
        if loader.epoch != epoch:
            loader._set_plan(epoch)

        def counts() -> _WorkerCounts:
            return _WorkerCounts(dataclasses.replace(loader.stats.reader), loader.stats.padded_records)

        for group in loader._groups(skip_batches):
            yield group, counts()
        yield [], counts()  # what the last blocks counted after the last group (skipped, gaps)
