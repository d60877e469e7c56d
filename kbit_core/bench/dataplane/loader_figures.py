"""The data-plane benchmark's loaders: which ones a variant is timed with (per ``reader.workers``, at two batch
sizes), and each one's rates and ratios against the same pass's fetch and read+decode."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kbit_core.config import KbitConfig

LARGE_BATCH = 512  # a GPU rank's per-rank batch, where per-batch costs matter least and per-record ones most


@dataclass
class LoaderFigures:
    """One loader's rates against the same pass's fetch and read+decode: at ``train.global_batch_size`` and at a
    per-rank batch of :data:`LARGE_BATCH`, medians, and the lowest and highest loader ÷ fetch of one round."""

    records_per_s: float
    ratio: float  # loader / fetch
    spread: list[float]
    decode_ratio: float  # loader / read+decode with the fast decoder
    large_batch_records_per_s: float
    large_batch_ratio: float
    large_batch_spread: list[float]
    large_batch_decode_ratio: float


def loader_configs(cfg: KbitConfig, workers: Sequence[str] = ()) -> dict[tuple[str, str], KbitConfig]:
    """The loaders :func:`measure_variant` times, ``(reader.workers, "default" | "large") -> config``: the config's
    own ``reader.workers`` first, then each other one of ``workers``, each at its batch and at :data:`LARGE_BATCH`."""
    modes = dict.fromkeys([cfg.reader.workers, *workers])
    large = {"train.global_batch_size": LARGE_BATCH}
    return {
        (w, b): cfg.override({"reader.workers": w, **(large if b == "large" else {})})
        for w in modes
        for b in ("default", "large")
    }


def loader_figures(
    records: int,
    fetch_s: list[float],
    decode_t: float,
    default_s: list[float],
    default_loaded: int,
    large_s: list[float],
    large_loaded: int,
) -> LoaderFigures:
    """One loader's figures over a topic of ``records``: rates are what it yielded (whole train batches only, a few
    records short of the topic) over its median seconds; ratios against the median fetch and read+decode
    (``decode_t`` seconds), spreads per round against that round's fetch."""
    f = statistics.median(fetch_s)

    def spread(seconds: list[float], loaded: int) -> list[float]:
        ratios = [loaded / records * ft / lt for ft, lt in zip(fetch_s, seconds)]
        return [round(min(ratios), 3), round(max(ratios), 3)]

    ld, large = statistics.median(default_s), statistics.median(large_s)
    return LoaderFigures(
        records_per_s=rate(default_loaded, ld),
        ratio=default_loaded / records * f / ld,
        spread=spread(default_s, default_loaded),
        decode_ratio=default_loaded / records * decode_t / ld,
        large_batch_records_per_s=rate(large_loaded, large),
        large_batch_ratio=large_loaded / records * f / large,
        large_batch_spread=spread(large_s, large_loaded),
        large_batch_decode_ratio=large_loaded / records * decode_t / large,
    )


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")
