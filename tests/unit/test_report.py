"""Reports written from synthetic raw timings: files exist, the numbers in them match the raw rows."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from kbit_core.bench.loading.measure import SAMPLE_COLUMNS, Sample
from kbit_core.bench.loading.report import (
    ReportFiles,
    load_stats,
    read_timings,
    rebuild_report,
    timings_frame,
    write_report,
)
from kbit_core.cli.bench_tables import results_table
from kbit_core.errors import ConfigError, StatisticsError

CONFIGS = ("avro_list_lz4.confluent", "json_list_none.confluent")


START_UNIX_S = 1_790_000_000.0  # when the synthetic benchmark's first iteration began


def synthetic_rows(
    iterations: int = 4,
    warmup: int = 1,
    world_size: int = 2,
    seed: int = 0,
    configs: tuple[str, ...] = CONFIGS,
    slowdown: dict[str, float] | None = None,
) -> list[dict]:
    """Raw rows as the runner records them; configuration i is about i+1 times as slow as the first (json
    about twice avro), warm-ups 10× slower, ``slowdown`` multiplies named configurations. Every iteration
    also draws one noise factor all its ranks share (the broker and the CPU they share), as on a real machine."""
    rng = np.random.default_rng(seed)
    rows = []
    for it in range(-warmup, iterations):
        shared = rng.lognormal(0, 0.1)
        for pos, ci in enumerate(rng.permutation(len(configs))):
            name = configs[ci]
            fmt, layout, comp = name.split(".")[0].split("_")
            for rank in range(world_size):
                stages = (
                    rng.uniform(0.05, 0.1, size=5)
                    * (ci + 1)
                    * (10 if it < 0 else 1)
                    * shared
                    * (slowdown or {}).get(name, 1.0)
                )
                rows.append(
                    asdict(
                        Sample(
                            iteration=it,
                            warmup=it < 0,
                            config=name,
                            format=fmt,
                            layout=layout,
                            compression=comp,
                            records_per_message=1,
                            client="confluent",
                            decoder="fast",
                            network="loopback",
                            batch_size=64,
                            world_size=world_size,
                            rank=rank,
                            order_position=pos,
                            connect_s=stages[0],
                            fetch_s=stages[1],
                            decode_s=stages[2],
                            collate_s=stages[3],
                            other_s=stages[4],
                            load_s=float(stages.sum()),
                            records=500,
                            bytes=500 * 3200,
                            skipped_messages=int(it == 2 and rank == 1),
                            gap_offsets=0,
                            padded_messages=0,
                            padded_records=int(it == 2 and rank == 1),
                            dropped_messages=1,
                            kafka_clients=2,
                            train_epoch_s=float("nan"),
                            train_samples_per_s=float("nan"),
                            started_unix_s=START_UNIX_S + 60 * it + 5 * pos,
                            finished_unix_s=START_UNIX_S + 60 * it + 5 * pos + float(stages.sum()),
                            is_slowest_rank=False,
                        )
                    )
                )
    return rows


@pytest.fixture
def report(tmp_path: Path) -> tuple[ReportFiles, list[dict]]:
    rows = synthetic_rows()
    files = write_report(
        timings_frame(rows), {"iterations": 4, "warmup": 1, "world_size": 2}, tmp_path, bootstrap_resamples=200, seed=0
    )
    return files, rows


def test_every_file_is_written_and_non_empty(report: tuple[ReportFiles, list[dict]]) -> None:
    files, _ = report
    for path in files.paths():
        assert path.is_file() and path.stat().st_size > 0, path
    for png in (files.boxplot_png, files.mean_std_png, files.stages_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_json_matches_the_raw_rows(report: tuple[ReportFiles, list[dict]]) -> None:
    files, rows = report
    doc = json.loads(files.stats_json.read_text())
    measured = [r for r in rows if not r["warmup"]]
    for name in CONFIGS:
        mine = [r for r in measured if r["config"] == name]
        assert doc["raw_results"][name] == [r["load_s"] for r in mine]  # warm-ups excluded
        assert doc["statistical_analysis"][name]["count"] == 8  # the pooled per-rank view
        assert doc["statistical_analysis"][name]["median"] == pytest.approx(np.median([r["load_s"] for r in mine]))
        spans = [max(r["load_s"] for r in mine if r["iteration"] == it) for it in range(4)]
        means = [np.mean([r["load_s"] for r in mine if r["iteration"] == it]) for it in range(4)]
        assert doc["makespan"]["raw_results"][name] == pytest.approx(spans)
        assert doc["rank_mean"]["raw_results"][name] == pytest.approx(means)
        assert doc["makespan"]["statistical_analysis"][name]["count"] == 4  # one unit per iteration
        assert doc["throughput"][name]["bytes_per_record"] == 3200.0
        assert doc["configurations"][name]["format"] == name.split("_")[0]
        assert doc["counters"][name] == {
            "skipped_messages": 1,
            "gap_offsets": 0,
            "padded_messages": 0,
            "padded_records": 1,
            "dropped_messages": 1,
            "kafka_clients": 2,
        }
        assert set(doc["stages"][name]) == {"connect_s", "fetch_s", "decode_s", "collate_s", "other_s"}
    for metric in ("makespan", "rank_mean"):
        ranking = doc["comparison"][metric]["ranking"]
        assert [e["name"] for e in ranking] == list(CONFIGS)
        assert [e["runs"] for e in ranking] == [4, 4]  # iterations, not iterations × ranks
        # 4 vs 4 iterations can reach p = 2/70 < 0.05: one test, so it is reported.
        assert ranking[0]["significance"] == "reference" and ranking[0]["p_value"] is None
        assert ranking[1]["significance"] == "significant" and ranking[1]["p_holm"] == pytest.approx(2 / 70)
    assert "load_time" not in doc["comparison"]  # pooled ranks are never tested
    assert set(doc["metadata"]["order"]) == {"-1", "0", "1", "2", "3"}
    assert all(sorted(o) == sorted(CONFIGS) for o in doc["metadata"]["order"].values())
    assert doc["metadata"]["world_size"] == 2


def test_summary_lists_the_fastest_first_in_narrow_tables(report: tuple[ReportFiles, list[dict]]) -> None:
    files, _ = report
    text = files.summary_md.read_text()
    table = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(table) == 1 and "avro_list_lz4.confluent" in table[0] and table[0].endswith("| reference |")
    assert text.count("\n# ") == 0 and text.startswith("# kbit benchmark")  # one heading
    # MLflow's artifact viewer cuts wide tables: no table has more than seven columns.
    assert max(line.count("|") for line in text.splitlines() if line.startswith("|")) <= 8
    assert (
        "| skipped messages | gap offsets | padded messages | padded records | dropped messages | kafka clients |"
        in files.summary_md.read_text()
    )


def test_rebuild_from_the_csv_reproduces_the_stats(report: tuple[ReportFiles, list[dict]]) -> None:
    files, _ = report
    before = json.loads(files.stats_json.read_text())
    for path in files.paths():
        if path != files.raw_csv:
            path.unlink()
    files.stats_json.write_text(json.dumps({"metadata": before["metadata"]}))
    rebuilt = rebuild_report(files.raw_csv.parent)
    after = json.loads(rebuilt.stats_json.read_text())
    assert after["statistical_analysis"] == before["statistical_analysis"]
    assert after["metadata"] == before["metadata"]
    assert all(p.stat().st_size > 0 for p in rebuilt.paths())


def test_too_few_iterations_say_insufficient_runs_not_a_p(tmp_path: Path) -> None:
    files = write_report(timings_frame(synthetic_rows(iterations=3)), {}, tmp_path, bootstrap_resamples=100, seed=0)
    slower = json.loads(files.stats_json.read_text())["comparison"]["makespan"]["ranking"][1]
    # 3 vs 3 iterations: the smallest possible p is 2/20 = 0.1, so no claim can be made.
    assert (slower["significance"], slower["p_value"], slower["p_holm"]) == ("insufficient runs", None, None)
    assert "| insufficient runs |" in files.summary_md.read_text()


def test_csv_names_the_slowest_rank_flag_and_reads_back(report: tuple[ReportFiles, list[dict]]) -> None:
    files, _ = report
    header = files.raw_csv.read_text().splitlines()[0].split(",")
    assert "is_slowest_rank" in header and "makespan" not in header
    assert list(read_timings(files.raw_csv).columns) == list(SAMPLE_COLUMNS)


def test_only_warmup_rows_is_an_error(tmp_path: Path) -> None:
    rows = [r for r in synthetic_rows() if r["warmup"]]
    with pytest.raises(StatisticsError, match="only warm-up"):
        write_report(timings_frame(rows), {}, tmp_path, bootstrap_resamples=100, seed=0)


def test_missing_csv_column_is_named(tmp_path: Path) -> None:
    (tmp_path / "raw_timings.csv").write_text("iteration,config\n0,a\n")
    with pytest.raises(StatisticsError, match="lacks column"):
        rebuild_report(tmp_path)


# The configuration names and per-iteration orders the reports are keyed by come from the runner's matrix.


def test_matrix_names_are_stable_and_sweeps_extend_them() -> None:
    from kbit_core.config import KbitConfig
    from kbit_core.jobs.benchmark import matrix

    plain = KbitConfig.from_dict(
        {"bench": {"variants": [{"format": "avro"}], "clients": ["confluent", "kafka-python"]}}
    )
    assert [c.name for c in matrix(plain)] == ["avro_list_lz4.confluent", "avro_list_lz4.kafka-python"]
    swept = KbitConfig.from_dict(
        {"bench": {"variants": [{"format": "raw", "layout": "bytes"}], "batch_sizes": [32, 64], "world_sizes": [1, 2]}}
    )
    cells = matrix(swept)
    assert [c.name for c in cells] == [
        "raw_bytes_lz4.confluent.b32.w1",
        "raw_bytes_lz4.confluent.b64.w1",
        "raw_bytes_lz4.confluent.b32.w2",
        "raw_bytes_lz4.confluent.b64.w2",
    ]
    assert [(c.batch_size, c.world_size) for c in cells] == [(32, 1), (64, 1), (32, 2), (64, 2)]
    assert len(matrix(KbitConfig())) == 18  # the default matrix
    both = KbitConfig.from_dict({"bench": {"variants": [{"format": "avro"}], "decoders": ["fast", "stock"]}})
    assert [(c.name, c.decoder) for c in matrix(both)] == [
        ("avro_list_lz4.confluent.fast", "fast"),
        ("avro_list_lz4.confluent.stock", "stock"),
    ]


def test_matrix_refuses_duplicates() -> None:
    from kbit_core.config import KbitConfig
    from kbit_core.jobs.benchmark import matrix

    cfg = KbitConfig.from_dict({"bench": {"variants": [{"format": "json"}, {"format": "json"}]}})
    with pytest.raises(ConfigError, match="repeats configuration"):
        matrix(cfg)


def test_iteration_order_is_a_seeded_permutation_per_iteration() -> None:
    from kbit_core.config import KbitConfig
    from kbit_core.jobs.benchmark import iteration_order, matrix

    cfg = KbitConfig()
    cells = matrix(cfg)
    orders = [[c.name for c in iteration_order(cfg, cells, i)] for i in range(4)]
    assert all(sorted(o) == sorted(c.name for c in cells) for o in orders)
    assert len({tuple(o) for o in orders}) == 4  # reshuffled every iteration
    assert orders[2] == [c.name for c in iteration_order(cfg, cells, 2)]  # reproducible
    fixed = KbitConfig.from_dict({"bench": {"shuffle_order": False}})
    assert iteration_order(fixed, cells, 3) == cells


@pytest.mark.parametrize("width", [80, 100])
def test_the_results_table_is_whole_in_a_narrow_terminal(tmp_path: Path, width: int) -> None:
    """Issue 21: at 80 columns every figure of `kbit bench`'s table was cut to '0.3…'."""
    files = write_report(
        timings_frame(synthetic_rows(iterations=8)), {"iterations": 8}, tmp_path, bootstrap_resamples=100, seed=0
    )
    doc = json.loads(files.stats_json.read_text())
    console = Console(width=width, record=True, color_system=None)
    console.print(results_table(doc, console.width))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= width
    makespan = doc["makespan"]["statistical_analysis"][CONFIGS[0]]
    assert f"1. {CONFIGS[0]}" in text and f"{makespan['median']:.4f}" in text and "reference" in text
    assert f"[{makespan['median_ci_low']:.3f}, {makespan['median_ci_high']:.3f}]" in text


def test_a_network_axis_adds_the_networks_section(tmp_path: Path) -> None:
    names = ("avro_list_lz4.confluent", "avro_list_none.confluent")
    rows = []
    for network in ("loopback", "100mbit-2ms"):
        for row in synthetic_rows(configs=names, iterations=3, warmup=0):
            rows.append({**row, "config": f"{row['config']}@{network}", "network": network})
    meta = {"iterations": 3, "warmup": 0, "world_size": 2, "networks": {"loopback": None, "100mbit-2ms": 10**8}}
    files = write_report(timings_frame(rows), meta, tmp_path, bootstrap_resamples=200, seed=0)
    stats = load_stats(files.stats_json)
    assert stats["configurations"]["avro_list_lz4.confluent@100mbit-2ms"]["network"] == "100mbit-2ms"
    assert set(stats["network"]["fastest"]) == {"loopback", "100mbit-2ms"}
    [crossover] = stats["network"]["crossovers"]
    assert crossover["codec"].startswith("avro_list lz4 vs none")
    assert "## Networks" in files.summary_md.read_text()
    # a CSV from before the network axis reads as loopback
    frame = read_timings(files.raw_csv).drop(columns="network")
    frame.to_csv(tmp_path / "old.csv", index=False)
    assert set(read_timings(tmp_path / "old.csv")["network"]) == {"loopback"}
