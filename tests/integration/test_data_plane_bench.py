"""The data-plane benchmark end to end on a tiny matrix (`kbit bench-data`), and its variant-name parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kbit_core.bench.dataplane.data_plane import _require_same_batches, parse_variant
from kbit_core.cli import app
from kbit_core.config import DataVariant
from kbit_core.errors import ConfigError, KbitError
from kbit_core.formats import get_codec
from kbit_core.formats.base import DecodedBatch
from kbit_core.kafka import admin


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("raw_bytes_none", DataVariant(format="raw", layout="bytes", compression="none")),
        ("mongodb_avro_list_lz4", DataVariant(format="mongodb_avro", layout="list", compression="lz4")),
        ("avro_bytes_zstd_x8", DataVariant(format="avro", layout="bytes", compression="zstd", records_per_message=8)),
    ],
)
def test_parse_variant_round_trips_variant_names(name, variant):
    assert parse_variant(name) == variant and variant.name == name


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("xml_list_none", "does not start with a format"),
        ("json_list", "is not format_layout_compression"),
        ("json_list_brotli", "compression 'brotli'"),
        ("json_grid_lz4", "json_grid_lz4"),
        ("json_list_lz4_y2", "is not format_layout_compression"),
    ],
)
def test_parse_variant_rejects_bad_names(name, match):
    with pytest.raises(ConfigError, match=match):
        parse_variant(name)


@pytest.mark.kafka
def test_bench_data_cli_writes_rates_ratios_rss_and_targets(make_config, tmp_path):
    cfg = make_config()
    out, md = tmp_path / "results.json", tmp_path / "results.md"
    result = CliRunner().invoke(
        app,
        [
            "bench-data",
            "--set",
            f"kafka.embedded.port={cfg.kafka.embedded.port}",
            "--set",
            f"workdir={cfg.workdir}",
            "--records",
            "300",
            "-v",
            "raw_bytes_none",
            "--clients",
            "confluent",
            "--repeats",
            "1",
            "--rss-records",
            "200,1000",
            "--loader-workers",
            "partitions",
            "--out",
            str(out),
            "--markdown",
            str(md),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    assert (row["variant"], row["client"], row["records"]) == ("raw_bytes_none", "confluent", 300)
    for key in (
        "produce_records_per_s",
        "fetch_records_per_s",
        "decode_records_per_s",
        "stock_decode_records_per_s",
        "loader_records_per_s",
    ):
        assert row[key] > 0, key
    for prefix in ("", "stock_"):
        assert row[f"{prefix}decode_ratio"] == pytest.approx(
            row[f"{prefix}decode_records_per_s"] / row["fetch_records_per_s"]
        )
    assert row["speedup"] == pytest.approx(row["decode_records_per_s"] / row["stock_decode_records_per_s"])
    assert row["fast_decoder"] is False and row["speedup"] == 1.0  # raw has no fast decoder: one codec, timed once
    assert row["connect_ms"] > 0
    by_workers = row["loader_by_workers"]
    assert list(by_workers) == ["thread", "partitions"], "the config's own reader.workers first, then the others"
    assert by_workers["thread"]["ratio"] == row["loader_ratio"]
    for figures in by_workers.values():
        assert figures["records_per_s"] > 0  # (300 records hold no whole batch of 512)
        assert figures["spread"] == [pytest.approx(figures["ratio"], abs=1e-3)] * 2  # one round: the median is it
        assert figures["decode_ratio"] == pytest.approx(figures["records_per_s"] / row["decode_records_per_s"])
    assert [r["records"] for r in results["rss"]["runs"]] == [200, 1000]
    assert all(r["peak_rss_mb"] > 0 for r in results["rss"]["runs"])
    targets = {t["target"] for t in results["targets"]}
    assert any("decode >= 0.8x fetch" in t for t in targets) and any("RSS growth" in t for t in targets)
    assert "| synthetic_digits | raw_bytes_none | confluent |" in md.read_text()
    assert "| synthetic_digits | raw_bytes_none | confluent | partitions |" in md.read_text()
    assert not [t for t in admin.list_topics(cfg.kafka) if ".n300." in t or ".n1000." in t], "topics cleaned up"


@pytest.mark.kafka
def test_bench_data_reports_fast_and_stock_decoders_and_their_targets(make_config, tmp_path):
    cfg = make_config()
    out = tmp_path / "results.json"
    result = CliRunner().invoke(
        app,
        [
            "bench-data",
            "--set",
            f"kafka.embedded.port={cfg.kafka.embedded.port}",
            "--set",
            f"workdir={cfg.workdir}",
            "--records",
            "200",
            "-v",
            "avro_list_none",
            "--clients",
            "kafka-python",
            "--repeats",
            "1",
            "--no-rss",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fast_decoder"] is True and row["decode_only_speedup"] > 0
    targets = {t["target"] for t in json.loads(out.read_text())["targets"]}
    assert targets == {
        "avro_list_none (kafka-python) decode >= 0.5x fetch",
        "avro_list_none (kafka-python) connect stage <= 5 ms",
        "avro_list_none (kafka-python) fast read+decode >= 20x stock",
    }


@pytest.mark.kafka
def test_bench_data_measures_token_sequences_beside_the_digits_and_names_what_it_leaves_out(make_config, tmp_path):
    cfg = make_config()
    out, md = tmp_path / "results.json", tmp_path / "results.md"
    args = ["--set", f"kafka.embedded.port={cfg.kafka.embedded.port}", "--set", f"workdir={cfg.workdir}"]
    args += ["--datasets", "synthetic_digits", "--datasets", "synthetic_tokens", "-v", "raw_bytes_none"]
    args += ["-v", "avro_bytes_none", "--records", "200", "--repeats", "1", "--no-rss", "--out", str(out)]
    result = CliRunner().invoke(app, ["bench-data", *args, "--markdown", str(md), "--json"])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    cells = [(r["dataset"], r["variant"]) for r in results["rows"]]
    assert cells == [
        ("synthetic_digits", "raw_bytes_none"),
        ("synthetic_digits", "avro_bytes_none"),
        ("synthetic_tokens", "raw_bytes_none"),
    ]
    digits, _, tokens = results["rows"]
    # 10 bytes of index and label, then 784 pixels or 32 uint16 ids, after raw's 14-byte header
    assert (digits["bytes_per_record"], tokens["bytes_per_record"]) == (808, 88)
    assert tokens["decode_records_per_s"] > 0 and tokens["loader_records_per_s"] > 0
    (left_out,) = results["left_out"]
    assert (left_out["dataset"], left_out["variant"]) == ("synthetic_tokens", "avro_bytes_none")
    assert "avro/bytes carries uint8 pixels only" in left_out["reason"]
    assert results["meta"]["datasets"] == ["synthetic_digits", "synthetic_tokens"]
    assert any(t["target"].startswith("synthetic_tokens raw_bytes_none (confluent)") for t in results["targets"])
    assert "| synthetic_tokens | avro_bytes_none | avro/bytes carries uint8" in md.read_text()


def test_bench_data_times_kbits_decode_with_the_configured_decode_processes(make_config, tmp_path):
    cfg = make_config()
    out = tmp_path / "results.json"
    result = CliRunner().invoke(
        app,
        [
            "bench-data",
            "--set",
            f"kafka.embedded.port={cfg.kafka.embedded.port}",
            "--set",
            f"workdir={cfg.workdir}",
            "--set",
            "reader.decode_processes=1",
            "--records",
            "600",
            "-v",
            "json_list_none",
            "--clients",
            "confluent",
            "--repeats",
            "1",
            "--no-rss",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    # measure_variant raises unless the pooled decode, the stock decode and the loader each return all 600 records
    assert results["meta"]["decode_processes"] == row["decode_processes"] == 1
    assert row["records"] == 600 and row["decode_records_per_s"] > 0 and row["loader_records_per_s"] > 0


def test_bench_data_refuses_to_time_a_decoder_that_differs_from_the_stock_library():
    stock = get_codec("json", "list", (1, 2, 2), decoder="stock")
    values = stock.encode(np.arange(3), np.full((3, 1, 2, 2), 128, dtype=np.uint8), np.array([1, 2, 3]))

    class OneUlpOff:
        def decode(self, values):
            batch = stock.decode(values)
            pixels = batch.pixels.copy()
            pixels.view(np.uint32)[0, 0, 0, 0] += 1
            return DecodedBatch(batch.indices, batch.labels, pixels)

    _require_same_batches({"stock": stock, "fast": get_codec("json", "list", (1, 2, 2), decoder="fast")}, values, "t")
    with pytest.raises(KbitError, match="t: the fast decoder's pixels differ from the stock library's"):
        _require_same_batches({"stock": stock, "fast": OneUlpOff()}, values, "t")
