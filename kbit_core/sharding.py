"""Pure offset planning: partitions' half-open offset ranges -> train/val/test splits -> equal per-rank shards.

No I/O here. The original (DDP_KBIT ``split_offsets``) computed ``diff = end - start - 1`` on inclusive
ranges, capped windows at a short partition's end so one offset landed in two splits, and evened out only
the last split with unseeded random duplicates. This planner instead:

* splits every partition by the rates with exact rational arithmetic (largest remainder), contiguously,
  so each offset belongs to exactly one split;
* concatenates a split's ranges in partition order and cuts that sequence into ``world_size`` contiguous,
  equally long pieces, so with P == W equal partitions rank r reads exactly partition r's slice;
* evens ranks out by dropping a remainder window (which window rotates with ``(seed, epoch)``, so every
  message is eventually seen) or by padding with the rank's own earliest messages, and reports the counts.

:func:`block_order` turns one rank's shard into the per-epoch read order: blocks of at most ``block_size``
messages in a permuted order, each carrying the seed for permuting the samples decoded from it (the
block shuffle of mosaicml/streaming, trading shuffle quality for sequential Kafka reads).

A split by key hash (:mod:`kbit_core.key_splits`) comes in as runs of consecutive offsets (``plan``'s ``key_runs``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal

import numpy as np

SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")

Split = Literal["train", "val", "test"]
Remainder = Literal["drop", "pad"]


def split_names(rates: Sequence[float]) -> tuple[str, ...]:
    """The splits ``rates`` (shard.split_rates) define: train, then val, then test, one per rate."""
    return SPLIT_NAMES[: len(rates)]


@dataclass(frozen=True, order=True, slots=True)
class OffsetRange:
    """Messages ``start <= offset < stop`` of one Kafka partition."""

    partition: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.partition < 0 or self.start < 0 or self.stop < self.start:
            raise ValueError(f"invalid offset range: partition {self.partition}, [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def offsets(self) -> range:
        return range(self.start, self.stop)

    def inclusive_string(self) -> str:
        """The original's ``p:start:last`` form (last inclusive, so an empty range reads ``p:start:start-1``);
        :func:`parse_offset_strings` reads it back."""
        return f"{self.partition}:{self.start}:{self.stop - 1}"


def parse_offset_strings(items: Iterable[str]) -> dict[int, tuple[int, int]]:
    """Parse the original's inclusive ``"partition:start:last"`` strings into half-open ``{p: (start, stop)}``.

    Raises:
        ValueError: naming the offending string when it is malformed, inverted or repeats a partition.
    """
    out: dict[int, tuple[int, int]] = {}
    for item in items:
        parts = str(item).strip().split(":")
        try:
            partition, start, last = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"offset string {item!r} is not 'partition:start:last' with integers") from None
        if partition < 0 or start < 0 or last < start - 1:
            raise ValueError(f"offset string {item!r} has a negative number or last < start - 1")
        if partition in out:
            raise ValueError(f"offset string {item!r} repeats partition {partition}")
        out[partition] = (start, last + 1)
    return out


def split_counts(num_messages: int, rates: Sequence[Fraction]) -> list[int]:
    """Largest-remainder apportionment of ``num_messages`` by ``rates`` (exact; ties go to the earlier split)."""
    quotas = [num_messages * r for r in rates]
    counts = [int(q) for q in quotas]  # floor: quotas are non-negative
    leftover = num_messages - sum(counts)
    by_remainder = sorted(range(len(rates)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:leftover]:
        counts[i] += 1
    return counts


def exact_rates(rates: Sequence[float]) -> list[Fraction]:
    """``rates`` (shard.split_rates) as exact fractions summing to 1; ValueError naming them when they cannot be."""
    if not 1 <= len(rates) <= len(SPLIT_NAMES):
        raise ValueError(f"rates needs 1 to {len(SPLIT_NAMES)} entries (train, val, test), got {list(rates)}")
    if any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive, got {list(rates)}")
    # limit_denominator recovers 6/7 from its float; normalising makes the split counts sum exactly.
    exact = [Fraction(r).limit_denominator(1_000_000) for r in rates]
    total = sum(exact)
    if abs(float(total) - 1.0) > 1e-6:
        raise ValueError(f"rates must sum to 1, got {float(total):.6f}")
    return [r / total for r in exact]


@dataclass(frozen=True, slots=True)
class RankShard:
    """One rank's slice of one split.

    ``ranges`` are read in order (padding ranges come last); ``num_messages`` is identical on every rank
    of the split. ``padded`` counts this rank's repeated messages; ``dropped`` counts the split's messages
    that no rank reads this epoch (the same number on every rank).
    """

    split: str
    rank: int
    ranges: tuple[OffsetRange, ...]
    num_messages: int
    padded: int
    dropped: int
    records_per_message: int = 1

    @property
    def num_records(self) -> int:
        """Nominal sample count (``num_messages × records_per_message``)."""
        return self.num_messages * self.records_per_message


@dataclass(frozen=True, slots=True)
class Plan:
    """The splits of one topic and their per-rank shards for one epoch."""

    splits: Mapping[str, tuple[OffsetRange, ...]]
    shards: Mapping[str, tuple[RankShard, ...]]
    world_size: int
    epoch: int
    seed: int
    remainder: str
    records_per_message: int

    def shard(self, split: str, rank: int) -> RankShard:
        if split not in self.shards:
            raise ValueError(f"unknown split {split!r}; this plan has {list(self.shards)}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return self.shards[split][rank]

    def report(self) -> dict[str, dict[str, int]]:
        """Per split: messages in the split, per-rank messages, dropped and padded totals."""
        return {
            name: {
                "messages": sum(len(r) for r in self.splits[name]),
                "messages_per_rank": shards[0].num_messages,
                "dropped": shards[0].dropped,
                "padded": sum(s.padded for s in shards),
            }
            for name, shards in self.shards.items()
        }

    def fingerprint(self) -> str:
        """Stable hash of every split and shard: two plans agree exactly when their fingerprints do."""
        h = hashlib.sha256()
        h.update(f"{self.world_size}|{self.remainder}|{self.records_per_message}".encode())
        for name, shards in self.shards.items():
            for s in shards:
                h.update(f"|{name}:{s.rank}:{s.num_messages}:{s.padded}".encode())
                h.update(",".join(f"{r.partition}:{r.start}:{r.stop}" for r in s.ranges).encode())
        return h.hexdigest()[:16]


def plan(
    partitions: Mapping[int, tuple[int, int]],
    rates: Sequence[float] = (6 / 7, 1 / 14, 1 / 14),
    world_size: int = 1,
    epoch: int = 0,
    seed: int = 0,
    remainder: Remainder = "drop",
    records_per_message: int = 1,
    boundaries: Mapping[int, Sequence[int]] | None = None,
    key_runs: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
) -> Plan:
    """Split ``partitions`` (``{partition: (start, stop)}``, half-open) by ``rates`` and shard each split.

    Args:
        partitions: the offsets each partition holds, e.g. ``Manifest.ranges()``.
        rates: fractions for train, val and test (1 to 3 entries summing to 1).
        world_size: number of ranks; every rank of a split gets the same number of messages.
        epoch: selects, together with ``seed``, which remainder window is dropped (``remainder='drop'``).
        seed: see ``epoch``.
        remainder: ``'drop'`` the messages that do not divide evenly, or ``'pad'`` ranks by repeating
            their own earliest messages (the split's earliest when a rank has none).
        records_per_message: samples per Kafka message, carried into each shard's ``num_records``.
        boundaries: a split by time (``{partition: (offset, ...)}``, every partition's first offset at each
            split time, ascending): split i takes each partition's offsets from boundary i - 1 up to boundary i,
            the splits past the last boundary share the rest by their rates; None: every split takes its rate's
            share of each partition.
        key_runs: a split by key hash (``{partition: [(split, start, stop), ...]}``, :func:`kbit_core.key_splits.split_runs`, covering
            each partition's range in order): each run goes to its split, so a split's ranges are scattered over
            the partition; ``rates`` then only name the splits.

    Raises:
        ValueError: on a world size below 1, no or negative partitions, inverted ranges, bad rates, or a
            boundary missing or outside its partition.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if records_per_message < 1:
        raise ValueError(f"records_per_message must be >= 1, got {records_per_message}")
    if remainder not in ("drop", "pad"):
        raise ValueError(f"remainder must be 'drop' or 'pad', got {remainder!r}")
    if not partitions:
        raise ValueError("partitions is empty: nothing to plan")
    for p, (start, stop) in partitions.items():
        if p < 0 or start < 0 or stop < start:
            raise ValueError(f"partition {p} has an invalid range [{start}, {stop})")
    exact = exact_rates(rates)

    splits = _split_ranges(partitions, exact, boundaries, key_runs)
    shards = {
        name: _shard_split(name, ranges, world_size, epoch, seed, remainder, records_per_message)
        for name, ranges in splits.items()
    }
    return Plan(splits, shards, world_size, epoch, seed, remainder, records_per_message)


def _split_ranges(
    partitions: Mapping[int, tuple[int, int]],
    rates: Sequence[Fraction],
    boundaries: Mapping[int, Sequence[int]] | None,
    key_runs: Mapping[int, Sequence[tuple[int, int, int]]] | None,
) -> dict[str, tuple[OffsetRange, ...]]:
    """Each split's ranges, partition by partition: by rate, by time boundaries or by key-hash runs."""
    per_split: list[list[OffsetRange]] = [[] for _ in rates]
    for p in sorted(partitions):
        start, stop = partitions[p]
        if key_runs is not None:
            for split, first, last in _checked_runs(p, start, stop, len(rates), key_runs):
                per_split[split].append(OffsetRange(p, first, last))
            continue
        cursor = start
        for i, count in enumerate(_partition_counts(p, start, stop, rates, boundaries)):
            if count:
                per_split[i].append(OffsetRange(p, cursor, cursor + count))
            cursor += count
    return {SPLIT_NAMES[i]: tuple(r) for i, r in enumerate(per_split)}


def _checked_runs(
    partition: int, start: int, stop: int, num_splits: int, key_runs: Mapping[int, Sequence[tuple[int, int, int]]]
) -> Sequence[tuple[int, int, int]]:
    """A partition's key-hash runs, checked to cover its range ``[start, stop)`` in order with known splits."""
    runs = key_runs.get(partition, () if start == stop else None)
    if runs is None:
        raise ValueError(f"partition {partition} has no key-hash split runs")
    cursor = start
    for split, first, last in runs:
        if first != cursor or last <= first or not 0 <= split < num_splits:
            raise ValueError(
                f"partition {partition}: key-hash run ({split}, {first}, {last}) does not continue [{start}, {stop}) "
                f"at {cursor} into one of {num_splits} splits"
            )
        cursor = last
    if cursor != stop:
        raise ValueError(f"partition {partition}: key-hash runs end at {cursor}, its range at {stop}")
    return runs


def _partition_counts(
    partition: int, start: int, stop: int, rates: Sequence[Fraction], boundaries: Mapping[int, Sequence[int]] | None
) -> list[int]:
    """How many of a partition's messages each split takes: by rate, or split i up to its time boundary i and the
    splits past the last boundary the rest by their rates."""
    if boundaries is None:
        return split_counts(stop - start, rates)
    if partition not in boundaries:
        raise ValueError(f"partition {partition} has no split boundary")
    cuts = list(boundaries[partition])
    if not 1 <= len(cuts) <= max(1, len(rates) - 1):
        raise ValueError(f"partition {partition}: {len(cuts)} split boundaries for {len(rates)} splits")
    if any(not lo <= hi for lo, hi in zip([start, *cuts], [*cuts, stop])):
        raise ValueError(
            f"partition {partition}: split boundaries {cuts} are outside its range [{start}, {stop}) or out of order"
        )
    counts = [hi - lo for lo, hi in zip([start, *cuts], cuts)]
    later = rates[len(cuts) :]
    if not later:
        return counts
    total = sum(later)
    return [*counts, *split_counts(stop - cuts[-1], [r / total for r in later])]


def _slice(ranges: Sequence[OffsetRange], lo: int, hi: int) -> list[OffsetRange]:
    """Messages ``lo <= i < hi`` of the concatenation of ``ranges``, as ranges."""
    out: list[OffsetRange] = []
    pos = 0
    for r in ranges:
        a, b = max(lo, pos), min(hi, pos + len(r))
        if a < b:
            out.append(OffsetRange(r.partition, r.start + a - pos, r.start + b - pos))
        pos += len(r)
        if pos >= hi:
            break
    return out


def _repeat(ranges: Sequence[OffsetRange], count: int) -> list[OffsetRange]:
    """The first ``count`` messages of ``ranges`` cycled as often as needed."""
    total = sum(len(r) for r in ranges)
    out: list[OffsetRange] = []
    while count > 0:
        take = min(count, total)
        out.extend(_slice(ranges, 0, take))
        count -= take
    return out


def _shard_split(
    name: str, ranges: tuple[OffsetRange, ...], world_size: int, epoch: int, seed: int, remainder: str, rpm: int
) -> tuple[RankShard, ...]:
    total = sum(len(r) for r in ranges)
    if remainder == "drop":
        per_rank = total // world_size
        dropped = total - per_rank * world_size
        # Rotating the dropped window per epoch keeps the read contiguous yet lets every message be seen.
        shift = (
            int(np.random.default_rng([seed, epoch, SPLIT_NAMES.index(name)]).integers(0, dropped + 1))
            if dropped
            else 0
        )
        return tuple(
            RankShard(
                name,
                r,
                tuple(_slice(ranges, shift + r * per_rank, shift + (r + 1) * per_rank)),
                per_rank,
                0,
                dropped,
                rpm,
            )
            for r in range(world_size)
        )
    per_rank = -(-total // world_size)
    out = []
    for r in range(world_size):
        own = _slice(ranges, r * per_rank, min((r + 1) * per_rank, total))
        missing = per_rank - sum(len(x) for x in own)
        pad = _repeat(own or list(ranges), missing) if missing and total else []
        out.append(RankShard(name, r, tuple(own + pad), per_rank if total else 0, missing if total else 0, 0, rpm))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Block:
    """A contiguous run of at most ``block_size`` messages, read together; ``shuffle_key`` seeds the
    permutation of the samples decoded from it (``None``: keep their order)."""

    range: OffsetRange
    shuffle_key: tuple[int, ...] | None
    # Only samples first:stop of the permuted block (a piece of a block an elastic resume re-planned); stop None: all.
    first: int = 0
    stop: int | None = None

    def permutation(self, num_samples: int) -> np.ndarray:
        """The order the block's decoded samples are yielded in (only those of this piece)."""
        order = np.arange(num_samples)
        if self.shuffle_key is not None:
            order = np.random.default_rng(self.shuffle_key).permutation(num_samples)
        return order[self.first : self.stop]

    def single_record_count(self) -> int:
        """The samples this piece yields when every message holds one record."""
        return (len(self.range) if self.stop is None else self.stop) - self.first


def _cut(ranges: Iterable[OffsetRange], block_size: int) -> Iterator[OffsetRange]:
    for r in ranges:
        for a in range(r.start, r.stop, block_size):
            yield OffsetRange(r.partition, a, min(a + block_size, r.stop))


def block_order(shard: RankShard, seed: int, epoch: int, block_size: int, shuffle: bool = True) -> list[Block]:
    """The order in which ``shard`` is read in ``epoch``: deterministic in ``(seed, epoch, rank)``.

    Without ``shuffle`` the blocks follow the shard's ranges and keep their samples' order.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blocks = list(_cut(shard.ranges, block_size))
    if not shuffle:
        return [Block(b, None) for b in blocks]
    rng = np.random.default_rng([seed, epoch, shard.rank])
    order = rng.permutation(len(blocks))
    keys = rng.integers(0, 2**63 - 1, size=len(blocks))
    return [Block(blocks[i], (int(keys[j]),)) for j, i in enumerate(order)]


def remainder_pieces(orders: Sequence[Sequence[Block]], done: int, yielded: int, world_size: int) -> list[list[Block]]:
    """An epoch interrupted at one world size, re-planned for ``world_size`` ranks (one record per message).

    ``orders`` are the old ranks' block orders for the epoch; each old rank had yielded the first ``done`` of its
    ``yielded`` records. What is left, old rank after old rank, is cut into ``world_size`` contiguous runs whose
    lengths differ by at most one (a block split between two ranks becomes two pieces), so every record the epoch
    still owes is yielded exactly once.
    """
    left: list[Block] = []
    for blocks in orders:
        position = 0
        for block in blocks:
            first, stop = max(done - position, 0), min(yielded - position, len(block.range))
            if first < stop:
                left.append(replace(block, first=first, stop=stop))
            position += len(block.range)
    total = sum(piece.single_record_count() for piece in left)
    quota = [total // world_size + (1 if r < total % world_size else 0) for r in range(world_size)]
    out: list[list[Block]] = [[] for _ in range(world_size)]
    rank = 0
    for piece in left:
        while piece.single_record_count():
            while not quota[rank]:
                rank += 1
            take = min(quota[rank], piece.single_record_count())
            out[rank].append(replace(piece, stop=piece.first + take))
            quota[rank] -= take
            piece = replace(piece, first=piece.first + take)
    return out
