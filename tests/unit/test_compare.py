"""Ranking against the fastest configuration and the run-to-run gate, on one sample per iteration, Holm-corrected."""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console
from scipy.stats import mannwhitneyu

from kbit_core.bench.loading.report import analyze, timings_frame
from kbit_core.cli.bench_tables import comparison_table
from kbit_core.errors import StatisticsError
from kbit_core.stats.compare import compare_configs, compare_runs
from tests.unit.test_report import synthetic_rows

FAST = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
SLOW = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 1.98]
# The nightly matrix's size: 18 configurations, so 17 tests against the fastest and 18 between two nights.
NIGHTLY = tuple(
    f"{fmt}_{layout}_{comp}.confluent"
    for fmt in ("avro", "json", "protobuf", "bson", "raw")
    for layout in ("list", "bytes")
    for comp in ("lz4", "none")
    if (fmt, layout) != ("raw", "list")
)


def test_ranks_by_median_and_tests_each_against_the_fastest() -> None:
    c = compare_configs({"json": SLOW, "avro": FAST})
    assert (c.fastest, c.slowest) == ("avro", "json")
    best, other = c.entries
    assert (best.name, best.rank, best.ratio, best.p_value, best.significance) == ("avro", 1, 1.0, None, "reference")
    assert other.rank == 2 and other.runs == 8
    assert other.ratio == pytest.approx(np.median(SLOW) / np.median(FAST))
    assert other.slowdown_pct == pytest.approx((other.ratio - 1) * 100)
    # FAST repeats 1.0: with ties the exact distribution does not hold, so the normal approximation is used.
    assert other.p_value == pytest.approx(mannwhitneyu(FAST, SLOW, alternative="two-sided", method="asymptotic").pvalue)
    assert other.p_holm == other.p_value and other.significance == "significant"  # a family of one


def test_holm_corrects_across_the_configurations() -> None:
    rng = np.random.default_rng(1)
    samples = {"fast": FAST, "slow": SLOW, "same1": list(rng.permutation(FAST)), "same2": [v * 1.01 for v in FAST]}
    entries = {e.name: e for e in compare_configs(samples).entries}
    tested = [entries[n] for n in ("slow", "same1", "same2")]
    ps = sorted(e.p_value for e in tested)
    # Holm: the smallest p times 3, the next times 2 (never below the previous), the largest times 1.
    assert sorted(e.p_holm for e in tested) == pytest.approx(
        [min(1, 3 * ps[0]), min(1, max(3 * ps[0], 2 * ps[1])), min(1, max(3 * ps[0], 2 * ps[1], ps[2]))]
    )
    assert entries["slow"].significance == "significant" and entries["same1"].significance == "not significant"


def test_too_few_runs_for_the_family_are_insufficient() -> None:
    # 5 vs 5 runs: the smallest exact p is 2/252 = 0.0079 < 0.05 alone, but not below 0.05/17 among 17 tests.
    alone = compare_configs({"a": FAST[:5], "b": SLOW[:5]}).entries[1]
    assert alone.significance == "significant" and alone.p_holm == pytest.approx(2 / 252)
    many = {f"c{i}": [v * (1 + i / 10) for v in FAST[:5]] for i in range(18)}
    entries = compare_configs(many).entries
    assert all(e.significance == "insufficient runs" and e.p_value is None for e in entries[1:])


def test_median_not_mean_decides_the_ranking() -> None:
    # b has the lower mean (a's one huge outlier) but the higher median.
    c = compare_configs({"a": [1.0, 1.0, 1.0, 50.0], "b": [2.0, 2.0, 2.0, 2.0]})
    assert c.fastest == "a"


def test_bad_input_is_refused() -> None:
    with pytest.raises(StatisticsError, match="no configurations"):
        compare_configs({})
    with pytest.raises(StatisticsError, match="'b'"):
        compare_configs({"a": [1.0], "b": [float("nan")]})


def doc(samples: dict[str, list[float]]) -> dict:
    return {"makespan": {"raw_results": samples}, "rank_mean": {"raw_results": {k: v[:3] for k, v in samples.items()}}}


def nightly_stats(seed: int, slowdown: dict[str, float] | None = None, iterations: int = 10) -> dict:
    """A noisy night of the 18-configuration matrix on 2 ranks, analysed like a real run."""
    rows = synthetic_rows(iterations=iterations, warmup=0, seed=seed, configs=NIGHTLY, slowdown=slowdown)
    return analyze(timings_frame(rows), bootstrap_resamples=100, seed=0)


@pytest.mark.parametrize("metric", ["makespan", "rank_mean"])
def test_gate_passes_two_comparable_noisy_runs_and_flags_a_2x_slowdown(metric: str) -> None:
    baseline, tonight = nightly_stats(seed=1), nightly_stats(seed=2)
    quiet = compare_runs(baseline, tonight, threshold=0.10, metric=metric)
    assert len(quiet.deltas) == 18 and not quiet.regressions and not quiet.insufficient
    assert {d.b_runs for d in quiet.deltas} == {10}  # one sample per iteration, not per rank

    slowed = compare_runs(baseline, nightly_stats(seed=2, slowdown={NIGHTLY[5]: 2.0}), threshold=0.10, metric=metric)
    assert [d.name for d in slowed.regressions] == [NIGHTLY[5]]
    hit = slowed.regressions[0]
    assert hit.change_pct == pytest.approx(100, abs=25)
    # Significant after Holm across 18 tests: the raw p times at most 18 is still below alpha.
    assert hit.p_holm < 0.05 and hit.p_holm == pytest.approx(min(1.0, 18 * hit.p_value))


def test_regression_needs_both_size_and_significance() -> None:
    a = doc({"avro": FAST, "json": FAST, "gone": FAST})
    b = doc({"avro": [v * 1.5 for v in FAST], "json": [v * 1.05 for v in FAST], "new": FAST})
    result = compare_runs(a, b, threshold=0.10)
    by_name = {d.name: d for d in result.deltas}
    assert [d.name for d in result.regressions] == ["avro"]
    assert by_name["avro"].change_pct == pytest.approx(50.0)
    assert by_name["json"].verdict == "same"  # 5 % is under the threshold even though significant
    assert (result.only_in_a, result.only_in_b) == (("gone",), ("new",))


def test_too_few_iterations_give_no_verdict_instead_of_a_p() -> None:
    result = compare_runs(doc({"x": [1.0, 1.1, 0.9]}), doc({"x": [3.0, 3.1, 2.9]}), threshold=0.10)
    (delta,) = result.deltas
    assert (delta.verdict, delta.p_value) == ("insufficient runs", None) and not result.regressions
    assert result.to_dict()["insufficient_runs"] == ["x"]


def test_improvement_is_flagged_and_is_not_a_regression() -> None:
    result = compare_runs(doc({"x": SLOW}), doc({"x": FAST}), threshold=0.10)
    assert result.deltas[0].improvement and not result.regressions


def test_rank_mean_metric_reads_its_own_samples() -> None:
    result = compare_runs(doc({"x": FAST}), doc({"x": FAST}), threshold=0.1, metric="rank_mean")
    assert result.deltas[0].a_runs == 3


def test_missing_samples_are_a_clear_error() -> None:
    with pytest.raises(StatisticsError, match="no per-iteration samples for metric 'makespan'"):
        compare_runs({"raw_results": {"x": FAST}}, doc({"x": FAST}), threshold=0.1)
    with pytest.raises(StatisticsError, match="unknown comparison metric 'load_time'"):
        compare_runs(doc({"x": FAST}), doc({"x": FAST}), threshold=0.1, metric="load_time")  # type: ignore[arg-type]
    with pytest.raises(StatisticsError, match="threshold must be positive"):
        compare_runs(doc({"x": FAST}), doc({"x": FAST}), threshold=0)


def test_the_comparison_table_fits_80_columns_without_cutting_a_figure() -> None:
    few = nightly_stats(seed=1, iterations=3)  # 3 runs each: every verdict is "insufficient runs"
    slowed = nightly_stats(seed=2, slowdown={NIGHTLY[5]: 2.0})
    for a, b in ((few, few), (nightly_stats(seed=1), slowed)):
        result = compare_runs(a, b, threshold=0.10)
        console = Console(width=80, record=True, force_terminal=False)
        console.print(comparison_table(result))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "…" not in text
        words = text.upper().split()
        for delta in result.to_dict()["deltas"]:
            for figure in (f"{delta['change_pct']:+.1f}%", f"{delta['b_median']:.4f}", *delta["verdict"].split()):
                assert figure.upper() in words, figure
