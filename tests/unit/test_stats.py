"""Box-plot statistics against hand-computed values, numpy's percentiles and matplotlib's boxplot_stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib import cbook

from kbit_core.errors import StatisticsError
from kbit_core.stats.samples import (
    BoxStats,
    boxplot_stats,
    can_be_significant,
    holm_adjust,
    mann_whitney_p,
    olympic_mean,
    rate_median,
    smallest_mann_whitney_p,
)

HAND = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0]


def test_hand_computed_example() -> None:
    s = boxplot_stats(HAND, name="hand")
    # linear percentiles of 9 points: positions 2, 4, 6 -> 3, 5, 7
    assert (s.count, s.q1, s.median, s.q3, s.iqr) == (9, 3.0, 5.0, 7.0, 4.0)
    assert (s.lower_fence, s.upper_fence) == (-3.0, 13.0)
    assert s.lower_outliers == () and s.upper_outliers == (100.0,)
    assert (s.lower_whisker, s.upper_whisker) == (1.0, 8.0)
    assert s.mean == pytest.approx(136 / 9)
    assert s.variance == pytest.approx(np.var(HAND, ddof=1))
    assert s.std_dev == pytest.approx(math.sqrt(s.variance))
    assert (s.min, s.max) == (1.0, 100.0)
    assert s.olympic_mean == pytest.approx(35 / 7)  # drops 1 and 100
    assert s.median_ci_low <= s.median <= s.median_ci_high


def test_lower_outliers_are_strictly_outside_the_fence() -> None:
    # q1=10, q3=10, iqr=0: 10 sits exactly on both fences and is no outlier; 0 and 20 are.
    s = boxplot_stats([0.0, 10.0, 10.0, 10.0, 10.0, 10.0, 20.0])
    assert s.lower_outliers == (0.0,) and s.upper_outliers == (20.0,)
    assert s.lower_whisker == s.upper_whisker == 10.0


def test_single_sample_has_zero_variance_and_a_point_interval() -> None:
    s = boxplot_stats([2.5])
    assert s.count == 1 and s.variance == 0.0 and s.std_dev == 0.0
    assert s.q1 == s.median == s.q3 == s.min == s.max == s.olympic_mean == 2.5
    assert (s.median_ci_low, s.median_ci_high) == (2.5, 2.5)


def test_two_samples_use_the_plain_mean_as_olympic_mean() -> None:
    s = boxplot_stats([1.0, 3.0])
    assert s.olympic_mean == 2.0 and s.median == 2.0 and s.variance == 2.0
    assert (s.q1, s.q3) == (1.5, 2.5)


def test_all_equal_samples() -> None:
    s = boxplot_stats([0.7] * 12)
    assert s.iqr == 0.0 and s.variance == 0.0
    assert s.lower_outliers == s.upper_outliers == ()
    assert (s.median_ci_low, s.median_ci_high) == (0.7, 0.7)


@pytest.mark.parametrize("bad", [[1.0, float("nan")], [float("inf"), 2.0], [1.0, -float("inf")]])
def test_non_finite_input_is_refused_naming_the_configuration(bad: list[float]) -> None:
    with pytest.raises(StatisticsError, match="avro_list_lz4.*non-finite"):
        boxplot_stats(bad, name="avro_list_lz4")


def test_empty_input_is_refused_naming_the_configuration() -> None:
    with pytest.raises(StatisticsError, match="no samples for configuration 'json_list_none'"):
        boxplot_stats([], name="json_list_none")


def test_bootstrap_interval_is_seeded_and_contains_the_median() -> None:
    x = np.random.default_rng(3).lognormal(size=40)
    a = boxplot_stats(x, seed=7, bootstrap_resamples=500)
    b = boxplot_stats(x, seed=7, bootstrap_resamples=500)
    c = boxplot_stats(x, seed=8, bootstrap_resamples=500)
    assert (a.median_ci_low, a.median_ci_high) == (b.median_ci_low, b.median_ci_high)
    assert (a.median_ci_low, a.median_ci_high) != (c.median_ci_low, c.median_ci_high)
    assert a.median_ci_low < a.median < a.median_ci_high


def test_round_trips_through_dict() -> None:
    s = boxplot_stats(HAND)
    assert BoxStats.from_dict(s.to_dict()) == s


def test_olympic_mean_drops_one_min_and_one_max_only() -> None:
    assert olympic_mean(np.array([1.0, 1.0, 5.0, 9.0, 9.0])) == pytest.approx(5.0)


def test_rate_median_is_the_median_of_per_sample_rates() -> None:
    assert rate_median([100, 100, 300], [1.0, 2.0, 1.0]) == 100.0
    assert rate_median([2e6, 4e6], [1.0, 1.0], scale=1e6) == 3.0
    with pytest.raises(StatisticsError, match="non-positive duration"):
        rate_median([1, 2], [1.0, 0.0], name="x")
    with pytest.raises(StatisticsError, match="2 amounts but 1 durations"):
        rate_median([1, 2], [1.0], name="x")


samples = st.lists(st.floats(min_value=0.001, max_value=1000, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(samples)
def test_agrees_with_numpy_and_matplotlib(values: list[float]) -> None:
    x = np.array(values)
    s = boxplot_stats(x, bootstrap_resamples=100)
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    assert (s.q1, s.median, s.q3) == (pytest.approx(q1), pytest.approx(med), pytest.approx(q3))
    mpl = cbook.boxplot_stats(x, whis=1.5)[0]
    assert s.lower_whisker == pytest.approx(mpl["whislo"])
    assert s.upper_whisker == pytest.approx(mpl["whishi"])
    assert sorted(s.lower_outliers + s.upper_outliers) == pytest.approx(sorted(mpl["fliers"].tolist()))
    assert s.mean == pytest.approx(x.mean())
    assert s.min <= s.lower_whisker <= s.q1 <= s.median <= s.q3 <= s.upper_whisker <= s.max


def test_holm_adjust_hand_example_keeps_input_order() -> None:
    # Sorted 0.01, 0.03, 0.04, 0.5 -> 4·0.01, max(0.04, 3·0.03), max(0.09, 2·0.04), max(0.09, 0.5).
    assert holm_adjust([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm_adjust([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2·0.8 caps at 1; monotone after it


def test_exact_mann_whitney_reaches_its_smallest_p_on_separated_samples() -> None:
    a, b = np.arange(10.0), np.arange(10.0) + 100
    assert smallest_mann_whitney_p(10, 10) == pytest.approx(2 / 184756)  # 1.08e-5, not scipy's asymptotic 1.8e-4
    assert mann_whitney_p(a, b) == pytest.approx(smallest_mann_whitney_p(10, 10))
    assert mann_whitney_p(np.ones(4), np.ones(4)) == 1.0  # tied constant samples: 1, never NaN
    assert can_be_significant(6, 6, tests=17, alpha=0.05) and not can_be_significant(5, 5, tests=17, alpha=0.05)
