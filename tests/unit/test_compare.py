"""Ranking against the fastest configuration, and regression flags between two runs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from kbit_core.bench.compare import compare_configs, compare_runs
from kbit_core.errors import StatisticsError

FAST = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
SLOW = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 1.98]


def test_ranks_by_median_and_compares_with_the_fastest() -> None:
    c = compare_configs({"json": SLOW, "avro": FAST})
    assert (c.fastest, c.slowest) == ("avro", "json")
    best, other = c.entries
    assert (best.name, best.rank, best.ratio, best.slowdown_pct, best.p_value) == ("avro", 1, 1.0, 0.0, None)
    assert other.rank == 2
    assert other.ratio == pytest.approx(np.median(SLOW) / np.median(FAST))
    assert other.slowdown_pct == pytest.approx((other.ratio - 1) * 100)
    assert other.p_value == pytest.approx(mannwhitneyu(FAST, SLOW, alternative="two-sided").pvalue)
    assert other.p_value < 0.01


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
    return {"raw_results": samples, "makespan": {"raw_results": {k: [max(v)] * 3 for k, v in samples.items()}}}


def test_regression_needs_both_size_and_significance() -> None:
    a = doc({"avro": FAST, "json": FAST, "gone": FAST})
    b = doc({"avro": [v * 1.5 for v in FAST], "json": [v * 1.05 for v in FAST], "new": FAST})
    result = compare_runs(a, b, threshold=0.10)
    by_name = {d.name: d for d in result.deltas}
    assert [d.name for d in result.regressions] == ["avro"]
    assert by_name["avro"].change_pct == pytest.approx(50.0)
    assert not by_name["json"].regression  # 5 % is under the threshold even though significant
    assert (result.only_in_a, result.only_in_b) == (("gone",), ("new",))


def test_large_but_insignificant_slowdown_is_no_regression() -> None:
    a, b = doc({"x": [1.0, 3.0]}), doc({"x": [1.4, 3.4]})
    delta = compare_runs(a, b, threshold=0.10).deltas[0]
    assert delta.change_pct > 10 and delta.p_value >= 0.05 and not delta.regression


def test_improvement_is_flagged_and_is_not_a_regression() -> None:
    result = compare_runs(doc({"x": SLOW}), doc({"x": FAST}), threshold=0.10)
    assert result.deltas[0].improvement and not result.regressions


def test_makespan_metric_reads_the_makespan_samples() -> None:
    result = compare_runs(doc({"x": FAST}), doc({"x": FAST}), threshold=0.1, metric="makespan")
    assert result.deltas[0].a_median == max(FAST)


def test_missing_samples_are_a_clear_error() -> None:
    with pytest.raises(StatisticsError, match="no raw samples for metric 'load_time'"):
        compare_runs({}, doc({"x": FAST}), threshold=0.1)
    with pytest.raises(StatisticsError, match="threshold must be positive"):
        compare_runs(doc({"x": FAST}), doc({"x": FAST}), threshold=0)
