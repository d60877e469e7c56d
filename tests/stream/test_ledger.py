"""The stream's pure bookkeeping: partition assignment across world sizes, trained index runs, the audit."""

from __future__ import annotations

import pytest

from kbit_core.errors import ConfigError
from kbit_core.stream.ledger import add_run, assign_partitions, audit, expand_runs, extend_runs, lag_grows, percentiles


@pytest.mark.parametrize("partitions,world_size", [(1, 1), (2, 2), (4, 2), (4, 3), (6, 4), (7, 7)])
def test_every_partition_has_exactly_one_rank(partitions: int, world_size: int) -> None:
    assignment = assign_partitions(partitions, world_size)
    owned = sorted(p for ranks in assignment for p in ranks)
    assert owned == list(range(partitions))
    assert len(assignment) == world_size and all(assignment)
    assert assign_partitions(partitions, world_size) == assignment  # the same inputs, the same assignment


def test_the_assignment_changes_with_the_world_size() -> None:
    assert assign_partitions(4, 2) == ((0, 2), (1, 3))
    assert assign_partitions(4, 1) == ((0, 1, 2, 3),)
    assert assign_partitions(4, 3) == ((0, 3), (1,), (2,))


def test_more_ranks_than_partitions_is_a_config_error_naming_the_settings() -> None:
    with pytest.raises(ConfigError, match="launch.num_processes=3.*produce.partitions"):
        assign_partitions(2, 3)


def _train_round(
    positions: dict[int, int],
    trained: dict[int, list[list[int]]],
    partitions: int,
    world_size: int,
    records_per_rank: int,
) -> None:
    """Each rank trains its partitions' next records from the shared positions, as a resumed run does."""
    for owned in assign_partitions(partitions, world_size):
        for step in range(records_per_rank):
            p = owned[step % len(owned)]
            extend_runs(trained[p], [positions[p] * partitions + p], partitions)
            positions[p] += 1


def test_changing_world_size_between_rounds_neither_repeats_nor_skips() -> None:
    partitions = 4
    positions = dict.fromkeys(range(partitions), 0)
    trained: dict[int, list[list[int]]] = {p: [] for p in range(partitions)}
    for world_size in (2, 1, 3, 2):
        _train_round(positions, trained, partitions, world_size, records_per_rank=7)
    produced = {p: [[p, p + partitions * (positions[p] - 1)]] for p in range(partitions)}
    result = audit(trained, produced, partitions)
    assert result.exactly_once, result.summary()
    assert result.trained == sum(positions.values()) == 7 * (2 + 1 + 3 + 2)
    assert all(len(runs) == 1 for runs in trained.values())  # contiguous: one run per partition


def test_runs_merge_only_continuing_indices() -> None:
    runs: list[list[int]] = []
    extend_runs(runs, [1, 3, 5], stride=2)
    add_run(runs, 7, 11, stride=2)
    extend_runs(runs, [15], stride=2)
    assert runs == [[1, 11], [15, 15]]
    assert expand_runs(runs, 2).tolist() == [1, 3, 5, 7, 9, 11, 15]


def test_audit_names_missing_repeated_and_unexpected_indices() -> None:
    produced = {0: [[0, 8]], 1: [[1, 9]]}  # indices 0..9 over two partitions
    trained = {0: [[0, 4], [4, 8]], 1: [[1, 5], [9, 11]]}  # 4 twice, 7 missing, 11 never produced
    result = audit(trained, produced, 2)
    assert not result.exactly_once
    assert (result.repeated, result.missing, result.unexpected) == ([4], [7], [11])
    assert "1 missing" in result.summary()


def test_lag_grows_when_its_floor_rises_block_after_block() -> None:
    assert lag_grows([0, 1, 2, 3, 4, 5], windows=2)
    assert lag_grows([900, 10, 900, 20, 950, 30], windows=2)  # a saw tooth whose floor rises
    assert not lag_grows([900, 10, 900, 10, 950, 10], windows=2)  # bursts, but the trainer keeps up
    assert not lag_grows([1, 2, 3, 4, 5], windows=2)  # too few windows to tell


def test_percentiles_of_nothing_are_none() -> None:
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles(list(range(101)))["p95"] == pytest.approx(95.0)
