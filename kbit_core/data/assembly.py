"""A loader's counts, and the assembly of one epoch's batches from its decoded blocks: each block's rows permuted,
batches of exactly the schedule's sizes cut across block boundaries, the last ones padded if records were skipped."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kbit_core.data.batching import Batch, BlockRows, raw_batch
from kbit_core.data.reader import ReaderStats
from kbit_core.data.schedule import ShardSchedule
from kbit_core.errors import KbitError
from kbit_core.sharding import Block

log = logging.getLogger(__name__)


@dataclass
class LoaderStats:
    batches: int = 0
    records: int = 0
    padded_records: int = 0  # repeated to keep len() after corrupt records were skipped
    left_out_records: int = 0  # read from this rank's shard but not yielded: see ShardSchedule.left_out_records
    wait_seconds: float = 0.0  # time the consumer spent blocked waiting for a batch (data-wait)
    load_seconds: float = 0.0  # eager mode: reading and decoding the whole shard
    reader: ReaderStats = field(default_factory=ReaderStats)  # shared by every loader of a shared reader


class BatchAssembler:
    """Cuts the decoded blocks of ``schedule``'s epoch into its batches, counting padded records in ``stats``;
    ``permuted``: the blocks arrive already in their permuted order (``reader.workers: partitions``)."""

    def __init__(self, schedule: ShardSchedule, stats: LoaderStats, pin_memory: bool, permuted: bool = False) -> None:
        self.schedule, self.stats, self.pin_memory, self.permuted = schedule, stats, pin_memory, permuted

    def groups(
        self, decoded: Iterator[tuple[Block, Any]], skip_batches: int, skip_records: int
    ) -> Iterator[list[Batch]]:
        """Cut exact batches from each block's samples in its permuted order, yielded per block (uint8 pixels as
        decoded: :func:`~kbit_core.data.batching.model_inputs` converts them); pad from the last batch if the data
        ran short. Whole groups cross the prefetch queue: one hand-off per batch would cost a GIL
        switch interval (5 ms) each while the worker thread decodes (measured: 12k instead of 150k records/s), and a
        group's batches are gathered together (:meth:`BlockRows.take_many`)."""
        rows, sizes = BlockRows(self.pin_memory, convert=False), self.schedule.batch_sizes()
        total = len(sizes)
        emitted, last = skip_batches, None
        for block, batch in decoded:
            if emitted >= total:
                break
            count = len(batch.labels)
            if self.permuted:  # partitions: the worker already took the rows in the block's order
                order: np.ndarray | slice = slice(0, count)
            elif block.shuffle_key is None:  # in offset order: rows themselves, nothing to gather by index
                order = slice(block.first, block.stop)
            else:
                order = block.permutation(count)
            skip_records -= rows.push(batch.pixels, batch.labels, batch.indices, order, skip_records)
            fits, need = emitted, 0
            while fits < total and rows.size >= need + sizes[fits]:
                need += sizes[fits]
                fits += 1
            if fits > emitted:
                group = rows.take_many(sizes[emitted:fits])
                emitted, last = fits, group[-1]
                yield group
        group = []
        for size in sizes[emitted:]:
            last = self._padded(rows, last, size)
            group.append(last)
        if group:
            yield group

    def _padded(self, rows: BlockRows, last: Batch | None, size: int) -> Batch:
        """A batch of ``size``: the rows left, filled up by repeating them (or the last batch's when none is left)."""
        s = self.schedule
        have = rows.take_arrays(rows.size) if rows.size else None
        if have is None and last is None:
            raise KbitError(
                f"rank {s.rank} has no readable record in split {s.split!r} of topic "
                f"{s.manifest.topic!r} (all skipped as corrupt?) but must yield {len(s)} batches"
            )
        missing = size - (len(have[1]) if have is not None else 0)
        self.stats.padded_records += missing
        log.warning(
            "rank %d split %s: %d records short of len()=%d batches (skipped records?); repeating %d",
            s.rank,
            s.split,
            missing,
            len(s),
            missing,
        )
        if have is not None:
            reuse = np.arange(missing) % len(have[1])
            return raw_batch(*(np.concatenate([col, col[reuse]]) for col in have), pin_memory=self.pin_memory)
        reuse_rows = torch.from_numpy(np.arange(missing) % len(last.y))  # type: ignore[union-attr]
        x, y = (t[reuse_rows].pin_memory() if self.pin_memory else t[reuse_rows] for t in (last.x, last.y))  # type: ignore[union-attr]
        return Batch(x, y, last.indices[reuse_rows])  # type: ignore[union-attr]
