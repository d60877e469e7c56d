"""Invariants of the pure shard planner: exactly-once, equal ranks, determinism, and the original's bugs."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kbit_core.key_splits import key_hash_splits, split_runs
from kbit_core.sharding import (
    OffsetRange,
    RankShard,
    block_order,
    parse_offset_strings,
    plan,
    remainder_pieces,
    split_counts,
)

RATE_SETS = [(6 / 7, 1 / 14, 1 / 14), (0.5, 0.5), (1.0,), (0.85715, 0.071425, 0.071425), (0.8, 0.1, 0.1)]


def offsets_of(ranges) -> list[tuple[int, int]]:
    return [(r.partition, o) for r in ranges for o in r.offsets()]


def all_offsets(partitions) -> set[tuple[int, int]]:
    return {(p, o) for p, (a, b) in partitions.items() for o in range(a, b)}


partitions_st = st.dictionaries(
    st.integers(0, 7),
    st.tuples(st.integers(0, 50), st.integers(0, 120)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1,
    max_size=6,
)
rates_st = st.sampled_from(RATE_SETS)


# --- splits ---------------------------------------------------------------------------------------


@given(partitions_st, rates_st, st.integers(1, 9))
def test_every_offset_lands_in_exactly_one_split(partitions, rates, world_size):
    p = plan(partitions, rates, world_size)
    seen = Counter(o for ranges in p.splits.values() for o in offsets_of(ranges))
    assert set(seen) == all_offsets(partitions)
    assert max(seen.values(), default=1) == 1


def test_uneven_partitions_do_not_overlap_regression():
    """The original gave partition 1 train [0,49] and val [49,49]: offset 49 in two splits."""
    p = plan(parse_offset_strings(["0:0:99", "1:0:49"]), rates=(0.5, 0.5), world_size=1)
    assert p.splits["train"] == (OffsetRange(0, 0, 50), OffsetRange(1, 0, 25))
    assert p.splits["val"] == (OffsetRange(0, 50, 100), OffsetRange(1, 25, 50))
    train, val = set(offsets_of(p.splits["train"])), set(offsets_of(p.splits["val"]))
    assert not train & val


def test_default_rates_on_the_original_layout():
    """3 × 20,000 at 6/7, 1/14, 1/14: exact per-partition apportionment, nothing lost (original: off by one)."""
    p = plan(parse_offset_strings(["0:0:19999", "1:0:19999", "2:0:19999"]), world_size=3)
    assert p.splits["train"][0] == OffsetRange(0, 0, 17143)
    assert [len(r) for r in p.splits["val"]] == [1429] * 3
    assert [len(r) for r in p.splits["test"]] == [1428] * 3
    assert sum(v["messages"] for v in p.report().values()) == 60_000


@pytest.mark.parametrize(
    ("n", "rates", "expected"),
    [
        (70_000, (6 / 7, 1 / 14, 1 / 14), [60_000, 5_000, 5_000]),
        (10, (0.5, 0.5), [5, 5]),
        (3, (0.5, 0.5), [2, 1]),  # ties go to the earlier split
        (7, (1 / 3, 1 / 3, 1 / 3), [3, 2, 2]),
        (0, (0.8, 0.1, 0.1), [0, 0, 0]),
        (1, (0.8, 0.1, 0.1), [1, 0, 0]),
    ],
)
def test_split_counts_largest_remainder(n, rates, expected):
    exact = [Fraction(r).limit_denominator(1_000_000) for r in rates]
    assert split_counts(n, exact) == expected


# --- ranks ----------------------------------------------------------------------------------------


@settings(max_examples=150)
@given(partitions_st, rates_st, st.integers(1, 9), st.integers(0, 5), st.integers(0, 3))
def test_drop_gives_equal_disjoint_rank_shards(partitions, rates, world_size, epoch, seed):
    p = plan(partitions, rates, world_size, epoch=epoch, seed=seed, remainder="drop")
    for name, ranges in p.splits.items():
        split_offsets = set(offsets_of(ranges))
        shards = [p.shard(name, r) for r in range(world_size)]
        per_rank = [offsets_of(s.ranges) for s in shards]
        assert {len(o) for o in per_rank} == {len(split_offsets) // world_size}
        assert all(s.num_messages == len(o) for s, o in zip(shards, per_rank))
        flat = [o for rank in per_rank for o in rank]
        assert len(flat) == len(set(flat)), "a message went to two ranks"
        assert set(flat) <= split_offsets
        assert len(split_offsets) - len(flat) == shards[0].dropped < world_size


@settings(max_examples=150)
@given(partitions_st, rates_st, st.integers(1, 9))
def test_pad_covers_every_message_and_repeats_only_own_or_earliest(partitions, rates, world_size):
    p = plan(partitions, rates, world_size, remainder="pad")
    for name, ranges in p.splits.items():
        split_offsets = offsets_of(ranges)
        shards = [p.shard(name, r) for r in range(world_size)]
        counts = {len(offsets_of(s.ranges)) for s in shards}
        assert len(counts) == 1
        if not split_offsets:
            assert counts == {0}
            continue
        assert counts == {-(-len(split_offsets) // world_size)}
        owned = Counter()
        for s in shards:
            offs = offsets_of(s.ranges)
            real = offs[: len(offs) - s.padded]
            owned.update(real)
            # padding repeats the rank's own messages, or the split's earliest when it owns none
            assert set(offs[len(real) :]) <= (set(real) or set(split_offsets[: s.padded]))
        assert set(owned) == set(split_offsets) and max(owned.values()) == 1
        assert sum(s.padded for s in shards) == p.report()[name]["padded"] < world_size * max(counts)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_equal_partitions_equal_ranks_read_their_own_partition(world_size, remainder):
    """The original's layout: W partitions of equal size, rank r reads partition r's slice."""
    p = plan({q: (10, 10 + 700) for q in range(world_size)}, world_size=world_size, remainder=remainder)
    for name in ("train", "val", "test"):
        for r in range(world_size):
            shard = p.shard(name, r)
            assert {x.partition for x in shard.ranges} == {r}
            assert shard.padded == shard.dropped == 0


@pytest.mark.parametrize(("num_partitions", "world_size"), [(1, 2), (1, 4), (2, 3), (3, 2), (4, 3), (12, 5)])
def test_partitions_and_ranks_of_any_shape(num_partitions, world_size):
    parts = {q: (0, 97 + q) for q in range(num_partitions)}
    p = plan(parts, world_size=world_size)
    total_read = sum(p.shard(s, r).num_messages for s in p.splits for r in range(world_size))
    total_dropped = sum(v["dropped"] for v in p.report().values())
    assert total_read + total_dropped == sum(b - a for a, b in parts.values())


def test_dropped_window_rotates_with_epoch():
    parts = {0: (0, 101)}
    seen_over_epochs = set()
    dropped_sets = set()
    for epoch in range(12):
        p = plan(parts, rates=(1.0,), world_size=4, epoch=epoch, seed=3)
        read = {o for r in range(4) for o in offsets_of(p.shard("train", r).ranges)}
        seen_over_epochs |= read
        dropped_sets.add(frozenset(set(range(101)) - {o for _, o in read}))
    assert len(dropped_sets) > 1
    assert {o for _, o in seen_over_epochs} == set(range(101))


def test_plan_is_deterministic_and_fingerprinted():
    parts = {0: (0, 1000), 1: (5, 777), 2: (0, 3)}
    a = plan(parts, world_size=3, epoch=2, seed=7)
    b = plan(dict(reversed(parts.items())), world_size=3, epoch=2, seed=7)
    assert a.shards == b.shards and a.fingerprint() == b.fingerprint()
    assert plan(parts, world_size=2, epoch=2, seed=7).fingerprint() != a.fingerprint()


def test_num_records_counts_records_per_message():
    p = plan({0: (0, 40)}, rates=(1.0,), world_size=2, records_per_message=8)
    assert p.shard("train", 1).num_records == 20 * 8


# --- block shuffle --------------------------------------------------------------------------------


def _shard(n: int, rank: int = 0) -> RankShard:
    return RankShard("train", rank, (OffsetRange(0, 0, n // 2), OffsetRange(3, 100, 100 + n - n // 2)), n, 0, 0)


@given(st.integers(1, 400), st.integers(1, 64), st.integers(0, 5), st.integers(0, 5))
def test_block_order_is_a_permutation_of_the_shard(n, block_size, seed, epoch):
    shard = _shard(n)
    blocks = block_order(shard, seed, epoch, block_size)
    assert all(1 <= len(b.range) <= block_size for b in blocks)
    assert sorted(offsets_of(b.range for b in blocks)) == sorted(offsets_of(shard.ranges))
    assert block_order(shard, seed, epoch, block_size) == blocks


def test_block_order_changes_with_epoch_but_keeps_the_set():
    shard = _shard(1000)
    e0, e1 = block_order(shard, 1, 0, 10), block_order(shard, 1, 1, 10)
    assert [b.range for b in e0] != [b.range for b in e1]
    assert sorted(b.range for b in e0) == sorted(b.range for b in e1)
    perm0 = e0[0].permutation(10)
    assert sorted(perm0) == list(range(10))
    assert any(list(b0.permutation(10)) != list(b1.permutation(10)) for b0, b1 in zip(e0, e1))


def test_block_order_differs_between_ranks():
    assert [b.range for b in block_order(_shard(600, 0), 0, 0, 10)] != [
        b.range for b in block_order(_shard(600, 1), 0, 0, 10)
    ]


def test_unshuffled_order_is_sequential_and_identity():
    blocks = block_order(_shard(25), 0, 0, 4, shuffle=False)
    assert offsets_of(b.range for b in blocks) == offsets_of(_shard(25).ranges)
    assert all(list(b.permutation(3)) == [0, 1, 2] for b in blocks)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"partitions": {}}, "partitions is empty"),
        ({"partitions": {0: (10, 5)}}, r"partition 0 has an invalid range \[10, 5\)"),
        ({"partitions": {-1: (0, 5)}}, "partition -1"),
        ({"rates": (0.5, 0.4)}, "must sum to 1"),
        ({"rates": (1.2, -0.2)}, "must be positive"),
        ({"rates": ()}, "1 to 3 entries"),
        ({"rates": (0.25,) * 4}, "1 to 3 entries"),
        ({"remainder": "fill"}, "remainder must be"),
        ({"records_per_message": 0}, "records_per_message"),
    ],
)
def test_plan_rejects_bad_input(kwargs, match):
    args = {"partitions": {0: (0, 10)}, "world_size": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        plan(**args)


def test_shard_rejects_unknown_split_and_rank():
    p = plan({0: (0, 10)}, rates=(0.5, 0.5), world_size=2)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        p.shard("test", 0)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        p.shard("train", 2)


@pytest.mark.parametrize(
    ("strings", "match"),
    [
        (["0:0"], "'0:0' is not 'partition:start:last'"),
        (["a:0:9"], "'a:0:9'"),
        (["0:5:3"], "last < start - 1"),
        (["0:0:9", "0:10:19"], "repeats partition 0"),
    ],
)
def test_parse_offset_strings_rejects_bad_strings(strings, match):
    with pytest.raises(ValueError, match=match):
        parse_offset_strings(strings)


def test_parse_offset_strings_inclusive_to_half_open_and_back():
    parsed = parse_offset_strings(["2:0:5833", "11:0:5832", "3:7:6"])
    assert parsed == {2: (0, 5834), 11: (0, 5833), 3: (7, 7)}
    assert OffsetRange(2, 0, 5834).inclusive_string() == "2:0:5833"
    assert OffsetRange(3, 7, 7).inclusive_string() == "3:7:6"  # empty: last = start - 1
    ranges = [OffsetRange(p, *r) for p, r in parsed.items()]
    assert parse_offset_strings(r.inclusive_string() for r in ranges) == parsed


def test_block_order_rejects_zero_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_order(_shard(10), 0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    old_world=st.integers(1, 4),
    new_world=st.integers(1, 5),
    per_rank=st.integers(1, 60),
    block=st.integers(1, 9),
    done_fraction=st.floats(0, 1),
)
def test_remainder_pieces_owe_every_unread_record_once_in_near_equal_runs(
    old_world: int, new_world: int, per_rank: int, block: int, done_fraction: float
) -> None:
    """An epoch interrupted after ``done`` of each old rank's ``yielded`` records, re-planned for another world size:
    the pieces hold exactly the records still owed (by their place in each block's permuted order), the ranks'
    shares differ by at most one."""
    p = plan({0: (0, per_rank * old_world)}, [1.0], old_world)
    orders = [block_order(p.shard("train", r), 5, 1, block) for r in range(old_world)]
    yielded = per_rank - per_rank % 3  # a batch of 3: the tail is never yielded
    done = int(done_fraction * yielded)

    def records(blocks) -> list[tuple[int, int, int]]:  # (partition, first offset of the block, permuted sample)
        return [(b.range.partition, b.range.start, int(i)) for b in blocks for i in b.permutation(len(b.range))]

    owed = [rec for blocks in orders for rec in records(blocks)[done:yielded]]
    pieces = remainder_pieces(orders, done, yielded, new_world)
    got = [rec for mine in pieces for rec in records(mine)]
    assert got == owed
    shares = [sum(b.single_record_count() for b in mine) for mine in pieces]
    assert max(shares) - min(shares) <= 1 and len(pieces) == new_world


@settings(max_examples=200, deadline=None)
@given(partitions_st, rates_st, st.integers(1, 5), st.data())
def test_a_split_by_time_trains_before_each_boundary_and_evaluates_after(partitions, rates, world_size, data):
    """Every offset lands in exactly one split; train holds exactly the offsets below each partition's boundary."""
    boundaries = {p: (data.draw(st.integers(a, b)),) for p, (a, b) in partitions.items()}
    result = plan(partitions, rates, world_size, boundaries=boundaries)
    in_splits = [o for ranges in result.splits.values() for o in offsets_of(ranges)]
    before = {(p, o) for p, (a, _) in partitions.items() for o in range(a, boundaries[p][0])}
    assert set(offsets_of(result.splits["train"])) == before
    if len(rates) > 1:
        assert Counter(in_splits) == Counter(all_offsets(partitions))
    else:  # one split: the records after the boundary are left out
        assert set(in_splits) == before


def test_a_split_by_time_shares_the_later_records_by_the_later_rates():
    result = plan({0: (0, 100), 1: (10, 50)}, (0.5, 0.25, 0.25), 1, boundaries={0: (60,), 1: (10,)})
    assert result.splits["train"] == (OffsetRange(0, 0, 60),)
    assert result.splits["val"] == (OffsetRange(0, 60, 80), OffsetRange(1, 10, 30))
    assert result.splits["test"] == (OffsetRange(0, 80, 100), OffsetRange(1, 30, 50))


@pytest.mark.parametrize(
    ("boundaries", "match"),
    [
        ({0: (5,)}, "partition 1 has no split boundary"),
        ({0: (5,), 1: (99,)}, "boundaries \\[99\\] are outside its range"),
        ({0: (1, 2, 3), 1: (5,)}, "3 split boundaries for 2 splits"),
    ],
)
def test_a_split_by_time_rejects_missing_or_outside_boundaries(boundaries, match):
    with pytest.raises(ValueError, match=match):
        plan({0: (0, 10), 1: (0, 10)}, (0.5, 0.5), 1, boundaries=boundaries)


def test_split_boundaries_out_of_order_are_refused():
    with pytest.raises(ValueError, match="out of order"):
        plan({0: (0, 10)}, (0.8, 0.1, 0.1), 1, boundaries={0: (5, 3)})


def test_two_split_times_give_train_val_and_test_their_own_periods():
    result = plan({0: (0, 100)}, (0.8, 0.1, 0.1), 1, boundaries={0: (55, 60)})
    assert [result.splits[s] for s in ("train", "val", "test")] == [
        (OffsetRange(0, 0, 55),),
        (OffsetRange(0, 55, 60),),
        (OffsetRange(0, 60, 100),),
    ]


def test_a_split_by_key_hash_is_stable_and_keeps_each_key_in_one_split():
    keys = [b"user-0", b"user-16", b"user-1", b"", b"user-0", None]
    splits = key_hash_splits(keys, [0.8, 0.1, 0.1])
    # fixed values: a key's split never changes between runs, processes, hosts or kbit versions
    assert splits.tolist() == [1, 2, 0, 0, 1, -1]
    assert splits[0] == splits[4] and splits[-1] == -1  # the same key, the same split; a null key none
    again = key_hash_splits(reversed(keys), [0.8, 0.1, 0.1])
    assert again.tolist() == splits.tolist()[::-1]  # independent of the other keys and their order
    assert key_hash_splits([b"user-1"], [1.0]).tolist() == [0]


def test_a_split_by_key_hash_gives_each_split_its_share_of_keys():
    keys = [f"device-{i}".encode() for i in range(60_000)]
    counts = np.bincount(key_hash_splits(keys, [6 / 7, 1 / 14, 1 / 14]), minlength=3) / len(keys)
    assert np.allclose(counts, [6 / 7, 1 / 14, 1 / 14], atol=0.006)  # binomial sd ~0.001: 5 sd
    other_seed = key_hash_splits(keys[:1000], [0.5, 0.5], seed=1)
    assert (other_seed != key_hash_splits(keys[:1000], [0.5, 0.5])).any()  # the seed reshuffles keys
    with pytest.raises(ValueError, match="rates must sum to 1"):
        key_hash_splits(keys[:1], [0.5, 0.4])


def test_split_runs_cover_a_partition_and_give_gaps_to_the_run_before():
    # offsets 13 and 16 hold no record (a transaction marker, a compacted record)
    runs = split_runs([10, 11, 12, 14, 15, 17], [0, 0, 2, 2, 0, 1], start=10, stop=18)
    assert runs == [(0, 10, 12), (2, 12, 15), (0, 15, 17), (1, 17, 18)]
    assert split_runs([5, 6], [1, 1], start=3, stop=9) == [(1, 3, 9)]
    assert split_runs([], [], start=4, stop=4) == []


def test_a_plan_by_key_runs_gives_each_run_to_its_split_and_shards_them():
    runs = {0: [(0, 0, 4), (1, 4, 5), (0, 5, 9), (2, 9, 10)], 1: [(2, 0, 2), (0, 2, 6)], 2: []}
    result = plan({0: (0, 10), 1: (0, 6), 2: (3, 3)}, (0.8, 0.1, 0.1), world_size=2, key_runs=runs)
    assert result.splits == {
        "train": (OffsetRange(0, 0, 4), OffsetRange(0, 5, 9), OffsetRange(1, 2, 6)),
        "val": (OffsetRange(0, 4, 5),),
        "test": (OffsetRange(0, 9, 10), OffsetRange(1, 0, 2)),
    }
    assert [s.num_messages for s in result.shards["train"]] == [6, 6]
    assert result.shard("train", 0).ranges == (OffsetRange(0, 0, 4), OffsetRange(0, 5, 7))


@pytest.mark.parametrize(
    "runs, match",
    [
        ({0: [(0, 0, 5)]}, "runs end at 5, its range at 10"),
        ({0: [(0, 0, 5), (1, 6, 10)]}, r"does not continue \[0, 10\) at 5"),
        ({0: [(3, 0, 10)]}, "into one of 3 splits"),
        ({}, "partition 0 has no key-hash split runs"),
    ],
)
def test_key_runs_that_do_not_cover_a_partition_are_refused(runs, match):
    with pytest.raises(ValueError, match=match):
        plan({0: (0, 10)}, (0.8, 0.1, 0.1), 1, key_runs=runs)
