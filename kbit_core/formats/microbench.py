"""Encode/decode throughput of every codec on the same in-memory samples, as ratios to ``raw``.

Run ``python -m kbit_core.formats.microbench`` for a rich table; ``decode_rates`` returns the JSON-able numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kbit_core.formats import LAYOUTS, codec_names, get_codec, supported

BASELINE = "raw/bytes"


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sample_images(image_shape: Sequence[int], n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random uint8 images with about half the pixels zero (between real MNIST and Fashion-MNIST sparsity)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(1, 256, (n, *image_shape), dtype=np.uint8)
    images[rng.random(images.shape) < 0.5] = 0
    return np.arange(n, dtype=np.int64), images, rng.integers(0, 10, n)


def decode_rates(image_shape: Sequence[int] = (1, 28, 28), n: int = 20_000, records_per_message: int = 1,
                 repeats: int = 3, formats: Sequence[str] | None = None) -> dict[str, Any]:
    """Records/s of encode and decode for every supported format × layout.

    Args:
        image_shape: (C, H, W) of the samples. Defaults to MNIST's ``(1, 28, 28)``.
        n: Records per measurement. Defaults to ``20_000``.
        records_per_message: Samples per message value. Defaults to ``1``.
        repeats: Timings per codec; the median is reported. Defaults to ``3``.
        formats: Formats to measure; ``None`` means all (``raw`` is always measured, as the baseline).

    Returns:
        ``{"image_shape", "n", "records_per_message", "baseline", "codecs": {"<format>/<layout>":
        {"encode_rps", "decode_rps", "bytes_per_record", "decode_ratio_to_baseline"}}}``.
    """
    indices, images, labels = sample_images(image_shape, n)
    chosen = set(formats or codec_names()) | {BASELINE.split("/")[0]}
    codecs: dict[str, dict[str, float]] = {}
    for fmt in (f for f in codec_names() if f in chosen):
        for layout in LAYOUTS:
            if not supported(fmt, layout) or (fmt == "mongodb_avro" and records_per_message > 1):
                continue
            codec = get_codec(fmt, layout, image_shape, records_per_message, num_classes=10)
            values = codec.encode(indices, images, labels)
            codec.decode(values[:100])  # warm caches and lazy imports outside the timing
            encode_s = _median_seconds(lambda: codec.encode(indices, images, labels), repeats)
            decode_s = _median_seconds(lambda: codec.decode(values), repeats)
            codecs[f"{fmt}/{layout}"] = {"encode_rps": n / encode_s, "decode_rps": n / decode_s,
                                         "bytes_per_record": sum(map(len, values)) / n}
    base = codecs[BASELINE]["decode_rps"]
    for row in codecs.values():
        row["decode_ratio_to_baseline"] = row["decode_rps"] / base
    return {"image_shape": list(image_shape), "n": n, "records_per_message": records_per_message,
            "baseline": BASELINE, "codecs": codecs}


def render(result: dict[str, Any]) -> None:
    """Print ``decode_rates`` output as a rich table, fastest decode first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"codec throughput, {tuple(result['image_shape'])} × {result['n']:,} records, "
                        f"{result['records_per_message']} per message")
    for column in ("codec", "decode rec/s", "× raw", "encode rec/s", "bytes/rec"):
        table.add_column(column, justify="left" if column == "codec" else "right")
    for name, row in sorted(result["codecs"].items(), key=lambda kv: -kv[1]["decode_rps"]):
        table.add_row(name, f"{row['decode_rps']:,.0f}", f"{row['decode_ratio_to_baseline']:.3f}",
                      f"{row['encode_rps']:,.0f}", f"{row['bytes_per_record']:,.0f}")
    Console().print(table)


if __name__ == "__main__":
    import json
    import sys

    shape = tuple(int(d) for d in sys.argv[1].split("x")) if len(sys.argv) > 1 else (1, 28, 28)
    outcome = decode_rates(shape, int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)
    render(outcome)
    print(json.dumps(outcome))
