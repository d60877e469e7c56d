"""Benchmark reports from the raw timings: stats JSON, markdown summary, box/bar/stage plots.

Everything is derived from the raw timings CSV (one row per iteration × rank × configuration), so
``kbit report RUN_DIR`` can rebuild a report from that file alone. Warm-up rows stay in the CSV but never
enter a statistic. Tests and rankings use one sample per iteration (its makespan, and its mean over ranks);
the pooled per-rank samples are kept as the original's descriptive view.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kbit_core.bench.loading.measure import COUNTERS, SAMPLE_COLUMNS, STAGES
from kbit_core.bench.loading.plots import plot_boxplots, plot_mean_std, plot_stages
from kbit_core.config import LOOPBACK
from kbit_core.errors import StatisticsError
from kbit_core.stats.compare import METRICS, compare_configs
from kbit_core.stats.crossover import network_markdown, network_section
from kbit_core.stats.samples import boxplot_stats, rate_median

RAW_CSV = "raw_timings.csv"
STATS_JSON = "stats.json"
SUMMARY_MD = "summary.md"
BOXPLOT_PNG = "boxplot.png"
MEAN_STD_PNG = "mean_std.png"
STAGES_PNG = "stages.png"
CONFIG_FIELDS = (
    "format", "layout", "compression", "records_per_message", "client", "batch_size", "world_size", "network",
)  # fmt: skip
RANKING_METRIC = "makespan"
SIZE_COLUMNS = ("value B/record", "wire B/record")


@dataclass(frozen=True)
class ReportFiles:
    """Paths of every file one report consists of."""

    raw_csv: Path
    stats_json: Path
    summary_md: Path
    boxplot_png: Path
    mean_std_png: Path
    stages_png: Path

    @classmethod
    def in_dir(cls, out_dir: Path) -> ReportFiles:
        return cls(
            out_dir / RAW_CSV,
            out_dir / STATS_JSON,
            out_dir / SUMMARY_MD,
            out_dir / BOXPLOT_PNG,
            out_dir / MEAN_STD_PNG,
            out_dir / STAGES_PNG,
        )

    def to_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    def paths(self) -> list[Path]:
        return [Path(p) for p in asdict(self).values()]


def timings_frame(rows: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Raw timing rows (``measure.Sample`` dicts) as a frame with the CSV's column order."""
    frame = pd.DataFrame(list(rows), columns=list(SAMPLE_COLUMNS))
    if frame.empty:
        raise StatisticsError("no benchmark samples were recorded")
    return frame


def read_timings(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise StatisticsError(f"raw timings file not found: {path}")
    frame = pd.read_csv(path, float_precision="round_trip")
    if "network" not in frame.columns:  # a report from before the network axis: its links were not shaped
        frame["network"] = LOOPBACK
    missing = [c for c in SAMPLE_COLUMNS if c not in frame.columns]
    if missing:
        raise StatisticsError(f"raw timings file {path} lacks column(s) {missing}")
    return frame[list(SAMPLE_COLUMNS)]


def measured(timings: pd.DataFrame) -> pd.DataFrame:
    rows = timings[~timings["warmup"].astype(bool)]
    if rows.empty:
        raise StatisticsError("the raw timings hold only warm-up iterations")
    return rows


def config_order(rows: pd.DataFrame) -> list[str]:
    """Configurations in first-seen order of the matrix (stable across rebuilds of the same CSV)."""
    return list(dict.fromkeys(rows.sort_values(["iteration", "order_position", "rank"])["config"]))


def per_iteration(rows: pd.DataFrame) -> pd.DataFrame:
    """The independent units, one per iteration and configuration: the slowest rank's load time (makespan),
    the mean over ranks, and the records and bytes all ranks read."""
    grouped = rows.groupby(["config", "iteration"], sort=False)
    return grouped.agg(
        makespan_s=("load_s", "max"), rank_mean_s=("load_s", "mean"), records=("records", "sum"), bytes=("bytes", "sum")
    ).reset_index()


def iteration_orders(timings: pd.DataFrame) -> dict[str, list[str]]:
    """The configuration order each iteration ran in (warm-ups included), from the CSV's order positions."""
    firsts = timings.drop_duplicates(["iteration", "config"]).sort_values(["iteration", "order_position"])
    return {str(it): list(group["config"]) for it, group in firsts.groupby("iteration", sort=True)}


def analyze(timings: pd.DataFrame, *, bootstrap_resamples: int, seed: int) -> dict[str, Any]:
    """The stats document (without metadata): raw samples, box statistics, makespan view, rates, stages."""
    rows = measured(timings)
    names = config_order(rows)
    by_config = {name: group for name, group in rows.groupby("config", sort=False)}
    units = {name: group for name, group in per_iteration(rows).groupby("config", sort=False)}

    def view(frame: Mapping[str, pd.DataFrame], column: str, label: str) -> dict[str, Any]:
        """Raw samples and box statistics of one column per configuration."""
        return {
            "raw_results": {n: frame[n][column].tolist() for n in names},
            "statistical_analysis": {
                n: boxplot_stats(
                    frame[n][column].to_numpy(), name=f"{n}{label}", bootstrap_resamples=bootstrap_resamples, seed=seed
                ).to_dict()
                for n in names
            },
        }

    per_iteration_views = {metric: view(units, f"{metric}_s", f" ({metric})") for metric in METRICS}
    doc: dict[str, Any] = {
        "configurations": {n: configuration_fields(by_config[n]) for n in names},
        # The original's pooled per-rank view: descriptive only, never tested (ranks are not independent).
        **view(by_config, "load_s", ""),
        **per_iteration_views,
        "throughput": {n: throughput(by_config[n], units[n], n) for n in names},
        "stages": {n: {f"{s}_s": float(by_config[n][f"{s}_s"].median()) for s in STAGES} for n in names},
        # The maximum, not a median: one run that skipped or dropped data must show.
        "counters": {n: {c: int(by_config[n][c].max()) for c in COUNTERS} for n in names},
        "comparison": {
            metric: compare_configs(v["raw_results"]).to_dict() for metric, v in per_iteration_views.items()
        },
    }
    training = {n: training_stats(by_config[n], n) for n in names if by_config[n]["train_epoch_s"].notna().any()}
    if training:
        doc["training"] = training
    return doc


def configuration_fields(rows: pd.DataFrame) -> dict[str, Any]:
    """What a configuration consists of (format, layout, compression, client, sizes), from its first row."""
    first = rows.iloc[0]
    return {k: first[k].item() if hasattr(first[k], "item") else first[k] for k in CONFIG_FIELDS}


def throughput(rows: pd.DataFrame, spans: pd.DataFrame, name: str) -> dict[str, float]:
    """Median per-rank and per-run (all ranks over the makespan) rates, and the serialized size of a record."""
    records = float(rows["records"].sum())
    return {
        "records_per_s_median": rate_median(rows["records"], rows["load_s"], name=name),
        "mb_per_s_median": rate_median(rows["bytes"], rows["load_s"], name=name, scale=1e6),
        "makespan_records_per_s_median": rate_median(spans["records"], spans["makespan_s"], name=name),
        "makespan_mb_per_s_median": rate_median(spans["bytes"], spans["makespan_s"], name=name, scale=1e6),
        "records_per_rank_median": float(rows["records"].median()),
        "bytes_per_record": float(rows["bytes"].sum()) / records if records else 0.0,
    }


def training_stats(rows: pd.DataFrame, name: str) -> dict[str, float]:
    epoch = boxplot_stats(rows["train_epoch_s"].to_numpy(), name=f"{name} (train epoch)", bootstrap_resamples=100)
    return {
        "epoch_s_median": epoch.median,
        "epoch_s_iqr": epoch.iqr,
        "samples_per_s_median": float(rows["train_samples_per_s"].median()),
    }


def write_report(
    timings: pd.DataFrame, metadata: Mapping[str, Any], out_dir: Path, *, bootstrap_resamples: int, seed: int
) -> ReportFiles:
    """Write the raw CSV, stats JSON, markdown summary and plots into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = ReportFiles.in_dir(out_dir)
    timings.to_csv(files.raw_csv, index=False)
    doc = analyze(timings, bootstrap_resamples=bootstrap_resamples, seed=seed)
    # What the producer sent per record, compressed (from the manifests): beside the value size the ranks read.
    for name, wire in metadata.get("wire_bytes_per_record", {}).items():
        if name in doc["throughput"]:
            doc["throughput"][name]["wire_bytes_per_record"] = wire
    if metadata.get("networks"):
        doc["network"] = network_section(doc, metadata["networks"], resamples=bootstrap_resamples, seed=seed)
    doc["metadata"] = {
        **metadata,
        "order": iteration_orders(timings),
        "bootstrap_resamples": bootstrap_resamples,
        "bootstrap_seed": seed,
    }
    files.stats_json.write_text(json.dumps(doc, indent=2, allow_nan=False))
    files.summary_md.write_text(markdown_summary(doc))
    slowest_first = ranked_names(doc)[::-1]  # drawn bottom up: the fastest on top
    plot_boxplots(doc, slowest_first, files.boxplot_png)
    plot_mean_std(doc, slowest_first, files.mean_std_png)
    plot_stages(doc, slowest_first, files.stages_png)
    return files


def rebuild_report(run_dir: Path) -> ReportFiles:
    """Recompute every report file in ``run_dir`` from its raw CSV, keeping the recorded metadata."""
    files = ReportFiles.in_dir(run_dir)
    timings = read_timings(files.raw_csv)
    metadata = load_stats(run_dir).get("metadata", {}) if files.stats_json.is_file() else {}
    return write_report(
        timings,
        metadata,
        run_dir,
        bootstrap_resamples=int(metadata.get("bootstrap_resamples", 2000)),
        seed=int(metadata.get("bootstrap_seed", 0)),
    )


def load_stats(path: Path) -> dict[str, Any]:
    """A stats JSON document from its file or from the report directory holding it."""
    path = Path(path)
    file = path / STATS_JSON if path.is_dir() else path
    if not file.is_file():
        raise StatisticsError(f"no benchmark stats at {file}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise StatisticsError(f"benchmark stats {file} is not valid JSON: {exc}") from None


def ranked_names(doc: Mapping[str, Any]) -> list[str]:
    """Configurations fastest first, by median makespan per iteration."""
    return [e["name"] for e in doc["comparison"][RANKING_METRIC]["ranking"]]


def significance_label(entry: Mapping[str, Any]) -> str:
    """A ranking entry's test result for a table cell: the Holm-adjusted p, 'insufficient runs' or 'reference'."""
    return f"{entry['p_holm']:.2g}" if entry.get("p_holm") is not None else entry["significance"]


def markdown_summary(doc: Mapping[str, Any]) -> str:
    """Narrow tables (they fit MLflow's artifact viewer): the ranking by makespan per iteration with its test
    against the fastest, the per-rank view, stages and counters, fastest first."""
    return ranking_markdown(doc) + network_markdown(doc.get("network")) + details_markdown(doc)


def ranking_markdown(doc: Mapping[str, Any]) -> str:
    """The title, what was run, and the ranking with how it was tested."""
    meta = doc.get("metadata", {})
    comparison = doc["comparison"][RANKING_METRIC]
    title = " · ".join(str(v) for v in (meta.get("profile"), meta.get("run_id")) if v)
    return "\n".join(
        [
            f"# kbit benchmark {title}".rstrip(),
            "",
            run_line(meta),
            "",
            "## Ranking",
            "",
            "One sample per iteration: its makespan (the slowest rank, what a synchronous job waits for). "
            "CI = percentile-bootstrap 95 % interval of the median; *vs fastest* = two-sided Mann–Whitney U "
            f"against the fastest, Holm-adjusted across the {len(comparison['ranking']) - 1} tests (significant below "
            f"{comparison['alpha']}), or *insufficient runs* when so few iterations cannot reach significance.",
            "",
            ranking_table(doc),
        ]
    )


def run_line(meta: Mapping[str, Any]) -> str:
    """What was run, in one sentence: iterations, world size, broker, host CPUs, commit."""
    return (
        f"{meta.get('iterations', '?')} measured iterations (+{meta.get('warmup', '?')} warm-up), "
        f"world size {meta.get('world_size', '?')}, broker {meta.get('broker', '?')}, "
        f"host {meta.get('hardware', {}).get('cpu_count', '?')} CPUs, commit {meta.get('git_commit', '?')}."
    )


def ranking_table(doc: Mapping[str, Any]) -> str:
    """Configurations fastest first: runs, median makespan with its CI, ratio, the test against the fastest."""
    ranking = {e["name"]: e for e in doc["comparison"][RANKING_METRIC]["ranking"]}
    lines = ["| # | configuration | runs | makespan s [95% CI] | ratio | vs fastest |", "|---|---|---|---|---|---|"]
    for name in ranked_names(doc):
        m, r = doc["makespan"]["statistical_analysis"][name], ranking[name]
        lines.append(
            f"| {r['rank']} | {name} | {r['runs']} | {m['median']:.4f} [{m['median_ci_low']:.4f}, "
            f"{m['median_ci_high']:.4f}] | {r['ratio']:.2f} | {significance_label(r)} |"
        )
    return "\n".join(lines) + "\n"


def headline(doc: Mapping[str, Any]) -> str:
    """The answer in one sentence: the fastest configuration and how many are significantly slower."""
    comparison = doc["comparison"][RANKING_METRIC]
    fastest = comparison["fastest"]
    median = doc["makespan"]["statistical_analysis"][fastest]["median"]
    verdicts = [e["significance"] for e in comparison["ranking"][1:]]
    counts = ", ".join(
        f"{verdicts.count(v)} {v}" for v in ("significant", "not significant", "insufficient runs") if v in verdicts
    )
    return (
        f"Fastest: {fastest}, median makespan {median:.4f} s. Against it, the other {len(verdicts)}: "
        f"{counts or 'none'} (Holm-corrected Mann–Whitney on one sample per iteration)."
    )


def slower_count(doc: Mapping[str, Any]) -> str:
    """The significance in a few words, for a run name: '3 of 5 others significantly slower', and how many could
    not be tested ('…, 2 with too few runs to test')."""
    verdicts = [e["significance"] for e in doc["comparison"][RANKING_METRIC]["ranking"][1:]]
    untested = verdicts.count("insufficient runs")
    return f"{verdicts.count('significant')} of {len(verdicts)} others significantly slower" + (
        f", {untested} with too few runs to test" if untested else ""
    )


def record_sizes(doc: Mapping[str, Any], name: str) -> tuple[str, str]:
    """Bytes per record, rounded: the uncompressed value a rank reads, and what the producer sent (compressed
    record batches; '?' when the client could not count them)."""
    t = doc["throughput"][name]
    wire = t.get("wire_bytes_per_record")
    return f"{t['bytes_per_record']:,.0f}", f"{wire:,.0f}" if wire is not None else "?"


def sizes_markdown(doc: Mapping[str, Any], names: list[str]) -> list[str]:
    """The bytes per record table (its own, to keep every table within seven columns)."""
    lines = [
        "",
        "## Bytes per record",
        "",
        "| configuration | " + " | ".join(SIZE_COLUMNS) + " |",
        "|---|" + "---|" * len(SIZE_COLUMNS),
    ]
    return lines + [f"| {name} | {' | '.join(record_sizes(doc, name))} |" for name in names]


def details_markdown(doc: Mapping[str, Any]) -> str:
    """The per-rank view, stages, counters and the optional training epoch, fastest first."""
    names = ranked_names(doc)
    lines = [
        "",
        "## Per rank",
        "",
        "Rank mean = the mean over ranks per iteration (tested like the makespan); the per-rank median pools "
        "iterations × ranks (the original's view, descriptive only); rates are per rank. MB/s counts the "
        "uncompressed values a rank decodes, so a bigger encoding shows more MB/s while it takes longer: "
        "rank by time.",
        "",
        "| configuration | rank mean s | per-rank s [95% CI] | IQR s | records/s | MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        s, t = doc["statistical_analysis"][name], doc["throughput"][name]
        lines.append(
            f"| {name} | {doc['rank_mean']['statistical_analysis'][name]['median']:.4f} "
            f"| {s['median']:.4f} [{s['median_ci_low']:.4f}, {s['median_ci_high']:.4f}] | {s['iqr']:.4f} "
            f"| {t['records_per_s_median']:,.0f} | {t['mb_per_s_median']:.2f} |"
        )
    lines += [
        "",
        "## Stages",
        "",
        "Median seconds per rank.",
        "",
        "| configuration | " + " | ".join(STAGES) + " |",
        "|---|" + "---|" * len(STAGES),
    ]
    for name in names:
        st = doc["stages"][name]
        lines.append(f"| {name} | " + " | ".join(f"{st[f'{s}_s']:.4f}" for s in STAGES) + " |")
    lines += sizes_markdown(doc, names)
    lines += [
        "",
        "## Counters",
        "",
        "The most one rank had in one measured run.",
        "",
        "| configuration | " + " | ".join(c.replace("_", " ") for c in COUNTERS) + " |",
        "|---|" + "---|" * len(COUNTERS),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{doc['counters'][name][c]:,}" for c in COUNTERS) + " |")
    if "training" in doc:
        lines += [
            "",
            "## Training epoch",
            "",
            "| configuration | epoch s (median) | samples/s (median) |",
            "|---|---|---|",
        ]
        for name, t in doc["training"].items():
            lines.append(f"| {name} | {t['epoch_s_median']:.3f} | {t['samples_per_s_median']:,.0f} |")
    return "\n".join(lines) + "\n"
