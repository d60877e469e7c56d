"""Encode/decode throughput of every codec on the same in-memory samples, as ratios to ``raw``.

Run ``python -m kbit_core.formats.microbench`` for a rich table; ``decode_rates`` returns the JSON-able numbers.
``python -m kbit_core.formats.microbench 1x28x28 4096 fast`` prints ``fast_speedups``: each fast decoder against
its stock codec on the same values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

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


def decode_rates(
    image_shape: Sequence[int] = (1, 28, 28),
    n: int = 20_000,
    records_per_message: int = 1,
    repeats: int = 3,
    formats: Sequence[str] | None = None,
) -> dict[str, Any]:
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
            encode_s = _median_seconds(partial(codec.encode, indices, images, labels), repeats)
            decode_s = _median_seconds(partial(codec.decode, values), repeats)
            codecs[f"{fmt}/{layout}"] = {
                "encode_rps": n / encode_s,
                "decode_rps": n / decode_s,
                "bytes_per_record": sum(map(len, values)) / n,
            }
    base = codecs[BASELINE]["decode_rps"]
    for row in codecs.values():
        row["decode_ratio_to_baseline"] = row["decode_rps"] / base
    return {
        "image_shape": list(image_shape),
        "n": n,
        "records_per_message": records_per_message,
        "baseline": BASELINE,
        "codecs": codecs,
    }


def fast_speedups(
    image_shape: Sequence[int] = (1, 28, 28), n: int = 4096, repeats: int = 7, groupings: Sequence[int] = (1, 8)
) -> dict[str, Any]:
    """The decode step of every fast decoder against its stock codec on the same values.

    The samples are every other index (one partition of two, as a reader block holds them). Stock and fast
    decodes alternate, so load that drifts on a shared machine hits both; the best of ``repeats`` is kept.

    Returns:
        ``{"image_shape", "n", "rows": [{"codec", "records_per_message", "stock_us", "fast_us", "speedup"}]}``,
        microseconds per record.
    """
    indices, images, labels = sample_images(image_shape, n)
    indices = 2 * indices
    rows = []
    for fmt in codec_names():
        for layout in LAYOUTS:
            for rpm in groupings:
                if not supported(fmt, layout) or (fmt == "mongodb_avro" and rpm > 1):
                    continue
                stock = get_codec(fmt, layout, image_shape, rpm)
                fast = get_codec(fmt, layout, image_shape, rpm, decoder="fast")
                if fast is stock or type(fast) is type(stock):
                    continue
                values = stock.encode(indices, images, labels)
                stock_s, fast_s = [], []
                for _ in range(repeats):
                    stock_s.append(_median_seconds(partial(stock.decode, values), 1))
                    fast_s.append(_median_seconds(partial(fast.decode, values), 1))
                rows.append(
                    {
                        "codec": f"{fmt}/{layout}",
                        "records_per_message": rpm,
                        "stock_us": 1e6 * min(stock_s) / n,
                        "fast_us": 1e6 * min(fast_s) / n,
                        "speedup": min(stock_s) / min(fast_s),
                    }
                )
    return {"image_shape": list(image_shape), "n": n, "rows": rows}


def render(result: dict[str, Any]) -> None:
    """Print ``decode_rates`` output as a rich table, fastest decode first."""
    table = Table(
        title=f"codec throughput, {tuple(result['image_shape'])} × {result['n']:,} records, "
        f"{result['records_per_message']} per message"
    )
    for column in ("codec", "decode rec/s", "× raw", "encode rec/s", "bytes/rec"):
        table.add_column(column, justify="left" if column == "codec" else "right")
    for name, row in sorted(result["codecs"].items(), key=lambda kv: -kv[1]["decode_rps"]):
        table.add_row(
            name,
            f"{row['decode_rps']:,.0f}",
            f"{row['decode_ratio_to_baseline']:.3f}",
            f"{row['encode_rps']:,.0f}",
            f"{row['bytes_per_record']:,.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    import json
    import sys

    shape = tuple(int(d) for d in sys.argv[1].split("x")) if len(sys.argv) > 1 else (1, 28, 28)
    if sys.argv[3:] == ["fast"]:  # python -m kbit_core.formats.microbench 1x28x28 4096 fast
        print(json.dumps(fast_speedups(shape, int(sys.argv[2])), indent=1))
    else:
        outcome = decode_rates(shape, int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)
        render(outcome)
        print(json.dumps(outcome))
