"""Which batches one rank yields from one split in each epoch, and where the epoch stands.

Every rank of a split yields exactly ``len(schedule)`` batches (computed from the plan, never from what happened to
arrive), so DDP collectives never wait on a rank that ran out of data. The train split is block-shuffled per epoch
(``sharding.block_order``), val and test keep offset order. ``state_dict()`` is the mid-epoch resume state.

An elastic resume (``reshard``: a mid-epoch state of another world size) re-plans what the interrupted epoch still
owes: the old ranks' unread records, cut into equal runs for the new ranks (``sharding.remainder_pieces``), in an
equal number of batches on every rank of about the per-rank batch size. The next epoch is planned as usual.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.kafka.manifest import Manifest
from kbit_core.sharding import Block, Plan, RankShard, block_order, plan, remainder_pieces

log = logging.getLogger(__name__)

STATE_VERSION = 1


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


@dataclass(frozen=True)
class Resharded:
    """The rest of an epoch begun at another world size: this rank's pieces and batch sizes after ``done_before``
    batches (the old ranks' count), and the old ranks' states it was planned from (saved again, for a resume)."""

    sources: list[dict[str, Any]]
    done_before: int
    pieces: list[Block]
    sizes: list[int]


class ShardSchedule:
    """One rank's shard of ``split`` in each epoch: its plan, blocks, batch sizes and counts, and the batches done."""

    def __init__(self, cfg: KbitConfig, manifest: Manifest, split: str, rank: int, world_size: int, epoch: int) -> None:
        self.cfg, self.manifest, self.split, self.rank, self.world_size = cfg, manifest, split, rank, world_size
        self.batch_size = per_rank_batch_size(cfg.train.global_batch_size, world_size)
        self.shuffle = split == "train" and cfg.shard.shuffle
        self.records_per_message = manifest.variant.records_per_message
        self.block_messages = max(1, cfg.shard.block_records // self.records_per_message)
        # Only the dataset's last message can hold fewer records; counting it against every rank keeps
        # len() identical on all of them.
        self._short = manifest.num_messages * self.records_per_message - manifest.num_records
        self.batches_done = 0
        self.resume_at = 0  # the batch the next epoch's iteration starts at (set by load_state_dict)
        self.resharded: Resharded | None = None
        self.set_plan(epoch)

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
                records_per_message=self.records_per_message,
                boundaries=self._time_boundaries(),
                key_runs=self._key_runs(),
            )
        except ValueError as exc:
            raise ConfigError(f"cannot plan shards of topic {self.manifest.topic!r}: {exc}") from None

    def _time_boundaries(self) -> dict[int, list[int]] | None:
        """shard.split_by: time: each partition's first offset at each shard.split_times, found when the snapshot was
        taken."""
        if self.cfg.shard.split_by != "time":
            return None
        snapshot = self.manifest.source
        if snapshot is None or snapshot.split_offsets is None or snapshot.split_times != self.cfg.shard.split_times:
            raise ConfigError(
                f"shard.split_by: time needs a snapshot of topic {self.manifest.topic!r} taken for "
                f"shard.split_times={[t.isoformat() for t in self.cfg.shard.split_times]} (a user's topic, source.topic)"
            )
        return snapshot.split_offsets

    def _key_runs(self) -> dict[int, list[tuple[int, int, int]]] | None:
        """shard.split_by: key_hash: the runs of records whose keys hash to one split, found when the snapshot was
        taken (for these split_rates and seed)."""
        if self.cfg.shard.split_by != "key_hash":
            return None
        snapshot, shard = self.manifest.source, self.cfg.shard
        drawn_for = (shard.split_rates, shard.seed)
        if (
            snapshot is None
            or snapshot.key_runs is None
            or (snapshot.key_hash_rates, snapshot.key_hash_seed) != drawn_for
        ):
            raise ConfigError(
                f"shard.split_by: key_hash needs a snapshot of topic {self.manifest.topic!r} taken for "
                f"shard.split_rates={shard.split_rates} and shard.seed={shard.seed} (a user's topic, source.topic)"
            )
        return snapshot.key_runs

    def _plan_hash(self, p: Plan) -> str:
        return hashlib.sha256(f"{self.manifest.topic}|{p.fingerprint()}".encode()).hexdigest()[:16]

    def set_plan(self, epoch: int) -> None:
        self.epoch = epoch
        self.resharded = None
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
        if self.resharded is not None:
            return 0
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
        if self.resharded is not None:
            return self.resharded.done_before + len(self.resharded.sizes)
        return -(-self.num_records // self.batch_size)

    def batch_sizes(self) -> list[int]:
        """The size of each of the epoch's batches: ``batch_size``, the last one what is left."""
        if self.resharded is not None:
            return [self.batch_size] * self.resharded.done_before + self.resharded.sizes
        total = len(self)
        sizes = [self.batch_size] * total
        if total:
            sizes[-1] = self.num_records - (total - 1) * self.batch_size
        return sizes

    def blocks(self, skip_batches: int) -> tuple[list[Block], int]:
        """The epoch's blocks from the first one holding a batch not yet seen, and the records of them to skip."""
        if self.resharded is not None:
            blocks = list(self.resharded.pieces)
            skip_records = sum(self.resharded.sizes[: skip_batches - self.resharded.done_before])
            while blocks and blocks[0].single_record_count() <= skip_records:
                skip_records -= blocks.pop(0).single_record_count()
            return blocks, skip_records
        blocks = block_order(self.shard, self.cfg.shard.seed, self.epoch, self.block_messages, shuffle=self.shuffle)
        skip_records = skip_batches * self.batch_size
        if self.records_per_message == 1:  # block sizes are exact: resume without reading the blocks consumed
            while blocks and len(blocks[0].range) <= skip_records:
                skip_records -= len(blocks.pop(0).range)
        return blocks, skip_records

    def blocks_in_offset_order(self) -> list[Block]:
        """The shard's blocks unshuffled (the ranges eager mode reads, the same in every epoch's order)."""
        if self.resharded is not None:
            return self.resharded.pieces
        return block_order(self.shard, 0, 0, self.block_messages, shuffle=False)

    # -- epochs and resume -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch; calling it with the epoch being resumed keeps the resume point."""
        if epoch == self.epoch and self.resume_at:
            return
        self.set_plan(epoch)
        self.batches_done = self.resume_at = 0

    def start(self) -> int:
        """Begin iterating the epoch: the batches to skip (where a resume left off), counted as done."""
        skip_batches, self.resume_at = self.resume_at, 0
        self.batches_done = skip_batches
        return skip_batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.cfg.shard.seed,
            "world_size": self.world_size,
            "plan_hash": self._plan_hash(self.plan),
            "resharded_from": self.resharded.sources if self.resharded is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the first batch not yet seen in ``state['epoch']``; the plan must be the same.

        ``{"resharded_from": [every old rank's state]}`` alone resumes a mid-epoch state of another world size
        (see :meth:`reshard`); a state this schedule saved inside such an epoch resumes it at the same world size.
        """
        if "batches_done" not in state:
            self.reshard(state["resharded_from"])
            return
        if state.get("resharded_from") and state.get("world_size") == self.world_size:
            self.reshard(state["resharded_from"])
            self.batches_done = self.resume_at = int(state["batches_done"])
            return
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
        self.set_plan(state["epoch"])
        self.batches_done = self.resume_at = int(state["batches_done"])

    def reshard(self, sources: list[dict[str, Any]]) -> None:
        """Resume the epoch that ``sources`` (each old rank's state, at another world size) stand in: this rank's
        share of what it still owes, every record of it exactly once (see the module docstring)."""
        old_world, epoch = len(sources), sources[0]["epoch"]
        done = {int(state["batches_done"]) for state in sources}
        if self.split != "train" or len(done) != 1 or any(state.get("resharded_from") for state in sources):
            raise ConfigError(
                "an elastic resume continues the train split of one epoch interrupted at one world size, every rank "
                "at the same batch; this checkpoint's loader states are not that (a second world-size change "
                "within one epoch?)"
            )
        if self.records_per_message != 1 or self.cfg.reader.workers == "process":
            raise ConfigError(
                f"resuming mid-epoch at world size {self.world_size} (written at {old_world}) needs one record per "
                "message and reader.workers=thread; resume at the same world size or from an epoch-end checkpoint"
            )
        old = ShardSchedule(self.cfg, self.manifest, self.split, 0, old_world, epoch)
        old.load_state_dict(sources[0])  # the same plan, seed and topic, or a ConfigError naming what changed
        orders = [
            block_order(old.plan.shard(self.split, rank), self.cfg.shard.seed, epoch, self.block_messages, self.shuffle)
            for rank in range(old_world)
        ]
        before = done.pop()
        pieces = remainder_pieces(orders, before * old.batch_size, old.num_records, self.world_size)
        counts = [sum(piece.single_record_count() for piece in mine) for mine in pieces]
        steps = -(-max(counts) // self.batch_size)
        if min(counts) < steps:
            raise ConfigError(
                f"epoch {epoch} has {sum(counts)} records left: too few for {self.world_size} ranks to take "
                f"{steps} equal steps; resume from an earlier checkpoint or on fewer ranks"
            )
        mine = counts[self.rank]
        self.set_plan(epoch)
        self.resharded = Resharded(
            sources, before, pieces[self.rank], [mine // steps + (i < mine % steps) for i in range(steps)]
        )
        self.batches_done = self.resume_at = before
