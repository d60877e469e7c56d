"""A split by message key hash: each key's split (stable in any process, host or run), and a partition's records as
the runs of consecutive offsets of one split that :func:`kbit_core.sharding.plan` takes (``key_runs``). Pure."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from fractions import Fraction

import numpy as np

from kbit_core.sharding import exact_rates


def key_hash_splits(keys: Iterable[bytes | None], rates: Sequence[float], seed: int = 0) -> np.ndarray:
    """The split of each message key (an index into ``rates``: 0 train, 1 val, 2 test), -1 for a null key.

    A key's 8-byte BLAKE2b hash (keyed by ``seed``), read as a fraction of 2**64, falls into the rates' cumulative
    intervals (exact rationals, as :func:`plan` uses): stable across processes, hosts, Python versions and runs,
    independent of partitioning and of the other keys, and each split takes its rate's share of distinct keys.
    Records without a key have no key to keep together: the caller decides where they go (-1).
    """
    bounds, total = [], Fraction(0)
    for rate in exact_rates(rates)[:-1]:
        total += rate
        bounds.append(int(total * 2**64))
    salt = seed.to_bytes(8, "little", signed=True)
    return np.fromiter(
        (
            -1
            if key is None
            else bisect.bisect_right(bounds, int.from_bytes(hashlib.blake2b(key, digest_size=8, key=salt).digest()))
            for key in keys
        ),
        np.int64,
    )


def split_runs(offsets: Sequence[int], splits: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """A partition's records (ascending ``offsets`` in ``[start, stop)``, each given its split) as ``(split, first,
    stop)`` runs covering ``[start, stop)``: a run of one split ends where the next record of another split is, so
    offsets holding no record (transaction markers, compaction) go with the run before them."""
    runs: list[list[int]] = []
    for offset, split in zip(offsets, splits, strict=True):
        if runs and runs[-1][0] == split:
            continue
        if runs:
            runs[-1][2] = offset
        runs.append([int(split), offset if runs else start, stop])
    return [(s, a, b) for s, a, b in runs]
