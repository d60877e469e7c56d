"""ShardLoader: one rank's batches of one split, streamed from Kafka or loaded eagerly, resumable mid-epoch.

Batches are ``(x float32 [B, C, H, W] in [0, 1], y int64 [B])``; on a CUDA rank images stay uint8 until the training
step's :func:`~kbit_core.data.batching.to_device` converts them on the GPU. The loader composes three parts: its
:class:`~kbit_core.data.schedule.ShardSchedule` (which batches, ``len()``, the resume state), a
:class:`~kbit_core.data.assembly.BatchAssembler` (decoded blocks into exact batches) and one mode from
:mod:`kbit_core.data.loader_modes` (where reading, decoding and assembly run). ``stream`` and ``eager`` yield identical
batches: eager only moves the reading in front of the first batch (the original's measurement, and the in-memory
baseline).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from kbit_core.config import ClientName, KbitConfig
from kbit_core.data.assembly import BatchAssembler, LoaderStats
from kbit_core.data.batching import Batch, model_inputs
from kbit_core.data.loader_modes import EagerMode, ProcessMode, StreamMode, loader_reader
from kbit_core.data.partition_workers import PartitionMode
from kbit_core.data.reader import RangeReader
from kbit_core.data.schedule import ShardSchedule, per_rank_batch_size
from kbit_core.kafka.manifest import Manifest
from kbit_core.sharding import OffsetRange, Plan, RankShard

__all__ = ["LoaderStats", "ShardLoader", "per_rank_batch_size"]

log = logging.getLogger(__name__)


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
        self.schedule = ShardSchedule(cfg, manifest, split, rank, world_size, epoch)
        self.batch_size = self.schedule.batch_size
        self.mode = cfg.reader.mode
        self.pin_memory = cfg.launch.use_gpu and torch.cuda.is_available() if pin_memory is None else pin_memory
        self._owns_reader = reader is None
        self.reader = reader or loader_reader(cfg, manifest, client, codec)
        self.stats = LoaderStats(reader=self.reader.stats)
        assembler = BatchAssembler(self.schedule, self.stats, self.pin_memory)
        self._eager = EagerMode(self.schedule, self.reader, assembler, self.stats)
        self._mode: StreamMode | EagerMode | ProcessMode | PartitionMode
        if self.mode == "eager":
            self._mode = self._eager
        elif cfg.reader.workers == "process":
            self._mode = ProcessMode(self.schedule, self.reader.client, self.stats, self.pin_memory)
        elif cfg.reader.workers == "partitions":
            permuted = BatchAssembler(self.schedule, self.stats, self.pin_memory, permuted=True)
            self._mode = PartitionMode(self.schedule, self.reader.client, self.stats, permuted)
        else:
            self._mode = StreamMode(self.schedule, self.reader, assembler)

    # -- the schedule's plan, counts and resume state --------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.schedule.epoch

    @property
    def plan(self) -> Plan:
        return self.schedule.plan

    @property
    def shard(self) -> RankShard:
        return self.schedule.shard

    @property
    def batches_done(self) -> int:
        return self.schedule.batches_done

    @property
    def num_records(self) -> int:
        """Records every rank yields per epoch (train: whole batches only)."""
        return self.schedule.num_records

    @property
    def tail_records(self) -> int:
        """Train records past the last whole batch, left out each epoch (which ones changes with the shuffle)."""
        return self.schedule.tail_records

    @property
    def left_out_records(self) -> int:
        """Records of this rank's shard an epoch does not yield (see :attr:`ShardSchedule.left_out_records`)."""
        return self.schedule.left_out_records

    def __len__(self) -> int:
        return len(self.schedule)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch; calling it with the epoch being resumed keeps the resume point."""
        self.schedule.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the first batch not yet seen in ``state['epoch']``; the plan must be the same."""
        self.schedule.load_state_dict(state)

    # -- iteration -----------------------------------------------------------------------------------------

    def load(self) -> dict[OffsetRange, Any]:
        """Read and decode the whole shard once (again only when the epoch's shard changes), as eager mode does."""
        return self._eager.load()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.iter_indexed():
            yield batch.x, batch.y

    def iter_indexed(self) -> Iterator[Batch]:
        """Like iterating the loader, with each batch's dataset sample indices. Batches cross the loader's threads
        and processes as decoded (uint8 pixels, a quarter of the bytes); they are converted here, on the consuming
        thread, in one operation per group of batches (:func:`~kbit_core.data.batching.model_inputs`), except on a
        CUDA rank (``pin_memory``): there uint8 pixels reach the training step as they are and
        :func:`~kbit_core.data.batching.to_device` converts them on the GPU."""
        schedule = self.schedule
        for group in self._timed(self._mode.groups(schedule.start())):
            for batch in group if self.pin_memory else model_inputs(group):
                schedule.batches_done += 1
                self.stats.batches += 1
                self.stats.records += len(batch.y)
                yield batch
        left_out, tail = schedule.left_out_records, schedule.tail_records
        self.stats.left_out_records += left_out
        if left_out > tail:
            log.info(
                "rank %d split %s epoch %d: %d records of this rank's shard left out (%d past the last whole "
                "batch, %d to yield as many as the rank holding the dataset's short last message)",
                self.rank,
                self.split,
                schedule.epoch,
                left_out,
                tail,
                left_out - tail,
            )

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

    def close(self) -> None:
        self._mode.close()
        if self._owns_reader:
            self.reader.close()
        self._eager.close()

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
