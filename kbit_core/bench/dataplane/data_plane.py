"""Data-plane benchmark: per payload × variant × client, how close read+decode gets to the raw fetch rate of the
same topic. The payload is the dataset (``bench.datasets``: e.g. the digits' 784-byte images and synthetic_tokens'
uint16 token sequences, measured in the same run).

Every rate is measured in the same run against its own ceiling (``fetch``: the reader's exact-range fetch
without decoding, same topic, same client), so results are ratios that survive a noisy, shared machine.
``decode`` adds kbit's fast decoder and ``stock_decode`` the format's own library on the same records (what a format
costs with kbit, and what it costs without); ``loader`` is the full per-rank path (block shuffle, batching, float32 tensors,
prefetch thread). Produce throughput comes from the manifest. Streaming memory is measured by :mod:`.stream_rss`, the
tables drawn by :mod:`.data_plane_report`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

import confluent_kafka
from rich.progress import Progress

from kbit_core.bench.dataplane.bench_topics import bench_config, drop_topic, produce_or_reuse
from kbit_core.bench.dataplane.loader_figures import loader_configs, loader_figures, rate
from kbit_core.bench.dataplane.stream_rss import DEFAULT_RSS_RECORDS, TARGET_RSS_GROWTH_MB, measure_stream_rss
from kbit_core.config import COMPRESSIONS, FORMATS, ClientName, DatasetConfig, DataVariant, KbitConfig
from kbit_core.data.decode_pool import DecodePool
from kbit_core.data.reader import RangeReader
from kbit_core.data.split_loaders import make_split_loader, make_split_loaders
from kbit_core.datasets import open_source
from kbit_core.errors import ConfigError, KbitError
from kbit_core.formats import variant_codec
from kbit_core.formats.fast import FastPath
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest, manifest_codec
from kbit_core.sharding import OffsetRange, block_order, plan

# Targets the results are reported against (see docs/data_plane_benchmark.md).
BATCH_FETCH_LABEL = "kbit batches"  # the client column under reader.fetch: batches (kbit's own Fetch requests)
TARGET_DECODE_RATIO = {"bytes": 0.8, "list": 0.5}  # read+decode vs. the fetch rate of the same topic and client
TARGET_SPEEDUP = {("avro", "list"): 20.0, ("json", "list"): 5.0}  # fast read+decode over the stock library's
TARGET_CONFLUENT_RAW_RECORDS_PER_S = 100_000
TARGET_CONNECT_MS = 5.0


def parse_variant(name: str) -> DataVariant:
    """``format_layout_compression[_xN][_confluent]`` (e.g. ``mongodb_avro_list_lz4``, ``raw_bytes_zstd_x8``,
    ``avro_bytes_lz4_confluent``: the Confluent framing) -> variant."""
    framing = "confluent" if name.endswith("_confluent") else "kbit"
    name = name.removesuffix("_confluent")
    for fmt in sorted(FORMATS, key=len, reverse=True):
        if name.startswith(fmt + "_"):
            rest = name[len(fmt) + 1 :].split("_")
            break
    else:
        raise ConfigError(f"variant {name!r} does not start with a format ({', '.join(FORMATS)})")
    if len(rest) not in (2, 3) or (len(rest) == 3 and not (rest[2].startswith("x") and rest[2][1:].isdigit())):
        raise ConfigError(f"variant {name!r} is not format_layout_compression[_xN]")
    if rest[1] not in COMPRESSIONS:
        raise ConfigError(f"variant {name!r}: compression {rest[1]!r} is not one of {', '.join(COMPRESSIONS)}")
    try:
        return DataVariant(
            format=fmt,
            layout=rest[0],
            compression=rest[1],
            records_per_message=int(rest[2][1:]) if len(rest) == 3 else 1,
            framing=framing,
        )
    except ValueError as exc:
        raise ConfigError(f"variant {name!r}: {exc}") from None


# A reader or tool compared with kbit on each topic: (config, manifest, kbit's rows for the topic, repeats) -> results.
Peer = Callable[[KbitConfig, Manifest, list[dict[str, Any]], int], dict[str, Any]]


@dataclass
class DataPlaneRow:
    """One variant of one payload read with one client; rates are medians over the repeats."""

    dataset: str
    variant: str
    format: str
    layout: str
    compression: str
    records_per_message: int
    client: str  # the client whose consumer fetched, or BATCH_FETCH_LABEL (reader.fetch: batches)
    records: int
    value_mb: float
    bytes_per_record: float
    produce_records_per_s: float
    fetch_records_per_s: float
    fetch_mb_per_s: float
    decode_records_per_s: float  # read+decode with the fast decoder (the stock one where none applies)
    decode_mb_per_s: float
    stock_decode_records_per_s: float  # read+decode with the format's own library
    loader_records_per_s: float
    decode_ratio: float  # decode / fetch
    stock_decode_ratio: float  # stock decode / fetch
    loader_ratio: float  # loader / fetch, at train.global_batch_size
    loader_ratio_spread: list[float]  # lowest and highest loader / fetch of one round
    loader_large_batch_records_per_s: float  # the loader at a per-rank batch of LARGE_BATCH
    loader_large_batch_ratio: float
    loader_large_batch_ratio_spread: list[float]
    speedup: float  # read+decode, fast over stock
    decode_only_speedup: float  # the decode step alone, fast over stock
    fast_decoder: bool  # whether a fast decoder exists for the variant (else both columns are the stock library)
    decode_processes: int  # reader.decode_processes: worker processes beside the decoding thread (fast column, loader)
    connect_ms: float  # median connect stage: the consumer and one bounds check of the planned ranges
    # the loader per reader.workers measured (the config's own first: the loader_* fields above): see LoaderFigures
    loader_by_workers: dict[str, dict[str, Any]]


def whole_topic_blocks(cfg: KbitConfig, manifest: Manifest) -> list[OffsetRange]:
    rpm = manifest.variant.records_per_message
    shard = plan(manifest.ranges(), (1.0,), 1, records_per_message=rpm).shard("train", 0)
    return [b.range for b in block_order(shard, 0, 0, max(1, cfg.shard.block_records // rpm), shuffle=False)]


def measure_variant(
    cfg: KbitConfig, manifest: Manifest, client: ClientName, repeats: int = 3, workers: Sequence[str] = ()
) -> DataPlaneRow:
    """Time fetch, then decode with the fast and with the stock decoder, block by block over the whole topic, then
    the loader (``reader.decoder`` of ``cfg``) at ``train.global_batch_size`` and at :data:`LARGE_BATCH`, with the
    config's ``reader.workers`` and each other one of ``workers``, ``repeats`` times after a warm-up; medians, and each
    loader's loader ÷ fetch per round for its spread. Fetch and both decodes alternate per block, so load that drifts
    on a shared machine hits all three."""
    ranges = whole_topic_blocks(cfg, manifest)
    stock, fast = (manifest_codec(manifest, decoder, cfg.registry) for decoder in ("stock", "fast"))
    processes = cfg.reader.decode_processes
    # without a fast decoder (and no pool) both columns are the stock library, timed once
    pool = DecodePool(fast, processes) if processes else None
    codecs: dict[str, Any] = {"stock": stock}
    # a user's topic: its value decoder's fast path (kbit's Avro walker on a registry schema) sits inside the mapping
    has_fast = isinstance(fast, FastPath) or manifest.source is not None
    if has_fast or pool:
        codecs["fast"] = pool or fast
    batches = loader_configs(cfg, workers)
    fetch_s, decode_s, loader_s = [], {d: [] for d in codecs}, {b: [] for b in batches}
    loaded = dict.fromkeys(batches, 0)  # records one epoch of each loader yields (whole batches of train)
    with (
        contextlib.ExitStack() as loaders,
        RangeReader(
            cfg.kafka, cfg.reader.model_copy(update={"decode_processes": 0}), manifest.topic, stock, client
        ) as reader,
        pool or contextlib.nullcontext(),
    ):
        loader = {
            b: loaders.enter_context(make_split_loader(c, manifest, "train", 0, 1, client=client))
            for b, c in batches.items()
        }
        # one untimed pass of each: connections, metadata and offset checks stay outside the timed region; the
        # first block also shows that every timed decoder returns the stock library's batch
        for i, (_, records) in enumerate(reader.read_raw(ranges)):
            if i == 0:
                _require_same_batches(codecs, stock.decode_inputs(records), manifest.topic)
        for each in loader.values():
            sum(1 for _ in each)
        for _ in range(repeats):
            fetched, decoded, fetch_t, decode_t = timed_pass(reader, ranges, codecs)
            fetch_s.append(fetch_t)
            for name in codecs:
                decode_s[name].append(decode_t[name])
            for name, each in loader.items():
                t0 = time.perf_counter()
                loaded[name] = sum(len(y) for _, y in each)
                loader_s[name].append(time.perf_counter() - t0)
    if fetched != manifest.num_messages or set(decoded.values()) != {manifest.num_records}:
        raise KbitError(
            f"{manifest.topic}: read {fetched} messages / {decoded} records, the manifest has "
            f"{manifest.num_messages} / {manifest.num_records}"
        )
    return _row(cfg, manifest, client, fetch_s, decode_s, loader_s, loaded, has_fast)


def _row(
    cfg: KbitConfig,
    manifest: Manifest,
    client: ClientName,
    fetch_s: list[float],
    decode_s: dict[str, list[float]],
    loader_s: dict[tuple[str, str], list[float]],
    loaded: dict[tuple[str, str], int],
    fast_decoder: bool,
) -> DataPlaneRow:
    """One variant × client's medians as rates and ratios (decode rates include the fetch they follow), and each
    loader's figures (see :class:`LoaderFigures`)."""
    n, mb = manifest.num_records, manifest.value_bytes / 1e6
    f = statistics.median(fetch_s)
    stock_t = statistics.median(decode_s["stock"])
    fast_t = statistics.median(decode_s["fast"]) if "fast" in decode_s else stock_t
    # each loader's (seconds, records) at the default batch size, then at the large one
    sizes = ("default", "large")
    by_workers = {
        w: loader_figures(n, fetch_s, f + fast_t, *(x for s in sizes for x in (loader_s[w, s], loaded[w, s])))
        for w, _ in loader_s
    }
    own = by_workers[cfg.reader.workers]
    v = manifest.variant
    return DataPlaneRow(
        dataset=manifest.dataset.name,
        variant=v.name,
        format=v.format,
        layout=v.layout,
        compression=v.compression,
        records_per_message=v.records_per_message,
        client=client if cfg.reader.fetch == "messages" else BATCH_FETCH_LABEL,
        records=n,
        value_mb=round(mb, 3),
        bytes_per_record=round(manifest.value_bytes / max(n, 1), 1),
        produce_records_per_s=rate(n, manifest.produce_seconds),
        fetch_records_per_s=rate(n, f),
        fetch_mb_per_s=rate(mb, f),
        decode_records_per_s=rate(n, f + fast_t),
        decode_mb_per_s=rate(mb, f + fast_t),
        stock_decode_records_per_s=rate(n, f + stock_t),
        loader_records_per_s=own.records_per_s,
        loader_large_batch_records_per_s=own.large_batch_records_per_s,
        decode_ratio=f / (f + fast_t),
        stock_decode_ratio=f / (f + stock_t),
        loader_ratio=own.ratio,
        loader_ratio_spread=own.spread,
        loader_large_batch_ratio=own.large_batch_ratio,
        loader_large_batch_ratio_spread=own.large_batch_spread,
        speedup=(f + stock_t) / (f + fast_t),
        decode_only_speedup=rate(stock_t, fast_t),
        fast_decoder=fast_decoder,
        decode_processes=cfg.reader.decode_processes,
        connect_ms=1e3 * statistics.median(_connect_seconds(cfg, manifest, client)),
        loader_by_workers={w: asdict(figures) for w, figures in by_workers.items()},
    )


def timed_pass(
    reader: RangeReader, ranges: list[OffsetRange], codecs: dict[str, Any]
) -> tuple[int, dict[str, int], float, dict[str, float]]:
    """One read of ``ranges``, each block decoded by every codec in turn: messages fetched, records decoded per
    codec, seconds fetching and seconds decoding per codec."""
    fetched, decoded = 0, dict.fromkeys(codecs, 0)
    fetch_t, decode_t = 0.0, dict.fromkeys(codecs, 0.0)
    t0 = time.perf_counter()
    for _, records in reader.read_raw(ranges):
        fetch_t += time.perf_counter() - t0
        fetched += len(records)
        values = reader.codec.decode_inputs(records)
        for name, codec in codecs.items():
            t1 = time.perf_counter()
            decoded[name] += len(codec.decode(values).labels)
            decode_t[name] += time.perf_counter() - t1
        t0 = time.perf_counter()
    return fetched, decoded, fetch_t, decode_t


def _require_same_batches(codecs: dict[str, Any], values: Sequence[Any], topic: str) -> None:
    """KbitError unless every decoder in ``codecs`` returns the stock decoder's batch of ``values``, bit for bit."""
    batches = {name: codec.decode(values) for name, codec in codecs.items()}
    expected = batches["stock"]
    for name, batch in batches.items():
        for field in ("indices", "labels", "pixels"):
            got, want = getattr(batch, field), getattr(expected, field)
            if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                raise KbitError(
                    f"{topic}: the {name} decoder's {field} differ from the stock library's on the "
                    f"first block ({len(values)} values); not timing it"
                )


def _connect_seconds(cfg: KbitConfig, manifest: Manifest, client: ClientName, repeats: int = 7) -> list[float]:
    """Seconds of ``SplitLoaderSet.connect()`` (the benchmark's connect stage: the rank's consumer, and one bounds
    check of every split's ranges), each with fresh clients, after one untimed warm-up."""
    seconds = []
    for _ in range(repeats + 1):
        with make_split_loaders(cfg, manifest, 0, 1, client=client) as loaders:
            t0 = time.perf_counter()
            loaders.connect()
            seconds.append(time.perf_counter() - t0)
    return seconds[1:]


def evaluate_targets(rows: Sequence[DataPlaneRow], rss: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target that applies to the measured rows (and RSS runs) with its value and whether it is met."""
    out = []
    several_payloads = len({r.dataset for r in rows}) > 1
    for r in rows:
        ratio = TARGET_DECODE_RATIO[r.layout]
        cell = f"{r.dataset} {r.variant} ({r.client})" if several_payloads else f"{r.variant} ({r.client})"
        out.append(
            {
                "target": f"{cell} decode >= {ratio}x fetch",
                "value": round(r.decode_ratio, 3),
                "met": r.decode_ratio >= ratio,
            }
        )
        out.append(
            {
                "target": f"{cell} connect stage <= {TARGET_CONNECT_MS:g} ms",
                "value": round(r.connect_ms, 2),
                "met": r.connect_ms <= TARGET_CONNECT_MS,
            }
        )
        speedup = TARGET_SPEEDUP.get((r.format, r.layout))
        if speedup is not None:
            out.append(
                {
                    "target": f"{cell} fast read+decode >= {speedup:g}x stock",
                    "value": round(r.speedup, 2),
                    "met": r.speedup >= speedup,
                }
            )
        if r.client == "confluent" and r.format == "raw" and r.layout == "bytes":
            out.append(
                {
                    "target": f"{cell} decode >= {TARGET_CONFLUENT_RAW_RECORDS_PER_S:,} rec/s",
                    "value": round(r.decode_records_per_s),
                    "met": r.decode_records_per_s >= TARGET_CONFLUENT_RAW_RECORDS_PER_S,
                }
            )
    if rss is not None:
        out.append(
            {
                "target": f"stream peak RSS growth {rss['runs'][0]['records']:,} -> {rss['runs'][-1]['records']:,} "
                f"records <= {TARGET_RSS_GROWTH_MB:.0f} MB",
                "value": round(rss["peak_growth_mb"], 1),
                "met": rss["meets_target"],
            }
        )
    return out


def load_average() -> float:
    """The machine's 1-minute load average, rounded for reading."""
    return round(os.getloadavg()[0], 2)


def run_meta(bench_cfg: KbitConfig, repeats: int) -> dict[str, Any]:
    """Where and on what the run measured: host, dataset, reader settings and the broker behind every figure."""
    return {
        "created_at": datetime.now(UTC).isoformat(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "dataset": bench_cfg.dataset.name,
        "records": bench_cfg.dataset.num_records,
        "partitions": bench_cfg.produce.partitions,
        "repeats": repeats,
        "block_records": bench_cfg.shard.block_records,
        "decode_processes": bench_cfg.reader.decode_processes,
        "per_rank_batch": bench_cfg.train.global_batch_size,
        "broker": admin.describe_broker(bench_cfg.kafka),
        "broker_kind": "tansu" if bench_cfg.kafka.tansu else "apache-kafka",
        "clients": {"confluent-kafka": version("confluent-kafka"), "librdkafka": confluent_kafka.libversion()[0]},
        # a shared machine's load moves every wall-clock rate: read ratios, and this, beside them
        "load_average_1m_at_start": load_average(),
    }


def payloads(cfg: KbitConfig, datasets: Sequence[DatasetConfig] | None = None) -> list[KbitConfig]:
    """``cfg`` once per payload to measure: ``datasets``, else ``bench.datasets``, else ``cfg``'s own dataset."""
    chosen = datasets or cfg.bench.datasets
    if not chosen:
        return [cfg]
    return [cfg.override({"dataset": dataset.model_dump(mode="json")}) for dataset in chosen]


def carriable(cfg: KbitConfig, variants: Sequence[DataVariant]) -> tuple[list[DataVariant], list[dict[str, str]]]:
    """The variants ``cfg``'s dataset can travel in, and one ``{dataset, variant, reason}`` per one it cannot."""
    source = open_source(cfg.dataset)
    kept, left_out = [], []
    for variant in variants:
        try:
            variant_codec(variant, source)
        except ConfigError as exc:
            left_out.append({"dataset": source.name, "variant": variant.name, "reason": str(exc)})
        else:
            kept.append(variant)
    return kept, left_out


def run_data_plane(
    cfg: KbitConfig,
    *,
    records: int | None = None,
    variants: Sequence[DataVariant] | None = None,
    datasets: Sequence[DatasetConfig] | None = None,
    clients: Sequence[ClientName] | None = None,
    repeats: int = 3,
    rss_sizes: Sequence[int] | None = DEFAULT_RSS_RECORDS,
    keep_topics: bool = False,
    progress: bool = True,
    peers: Mapping[str, Peer] | None = None,
    loader_workers: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the whole benchmark and return the JSON-able results (meta, rows, left_out, rss, targets; and per entry
    of ``peers``, its comparison of each topic with these rows, e.g. ``ray_read_kafka``: see :mod:`.ray_data_peer`,
    :mod:`.spark_kafka_peer` and :mod:`.kafka_tools`). A peer's own targets join the run's. Each payload
    (``datasets``, see :func:`payloads`) is measured on every variant it can travel in (``left_out`` names the others).
    ``loader_workers``: further ``reader.workers`` to time the loader with, beside the config's own (each row's
    ``loader_by_workers``)."""
    runs = [bench_config(payload, records) for payload in payloads(cfg, datasets)]
    measured = [carriable(run, list(variants or cfg.bench.variants)) for run in runs]
    bench_cfg = runs[0]
    clients = list(clients or cfg.bench.clients)
    admin.require_embedded_listening(bench_cfg.kafka)
    meta = run_meta(bench_cfg, repeats)
    rows: list[DataPlaneRow] = []
    peers = dict(peers or {})
    compared: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("data-plane benchmark", total=sum(len(kept) for kept, _ in measured) * len(clients))
        for payload, (kept, _) in zip(runs, measured, strict=True):
            for variant in kept:
                manifest, created = produce_or_reuse(payload, variant, progress=False)
                try:
                    for client in clients:
                        bar.update(task, description=f"{payload.dataset.name} {variant.name} [{client}]")
                        rows.append(measure_variant(payload, manifest, client, repeats, loader_workers))
                        bar.advance(task)
                    for name, peer in peers.items():
                        bar.update(task, description=f"{variant.name} [{name}]")
                        compared[name].append(
                            peer(payload, manifest, [asdict(r) for r in rows[-len(clients) :]], repeats)
                        )
                finally:
                    if created and not keep_topics:
                        drop_topic(payload, manifest)
    rss = measure_stream_rss(cfg, rss_sizes, keep_topics, progress) if rss_sizes else None
    return {
        "meta": {**meta, "datasets": [run.dataset.name for run in runs], "load_average_1m_at_end": load_average()},
        "rows": [asdict(r) for r in rows],
        "left_out": [entry for _, left_out in measured for entry in left_out],
        "rss": rss,
        "targets": evaluate_targets(rows, rss)
        + [t for runs in compared.values() for c in runs for t in c.get("targets", [])],
        **compared,
    }
