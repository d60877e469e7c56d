"""Statistics of repeated measurements: box-plot statistics (the original's set plus Tukey whiskers, olympic
mean and a bootstrap CI of the median) and the significance tests between configurations (Mann–Whitney U
with Holm's correction). Pure: numbers in, numbers out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from math import comb
from typing import Any

import numpy as np
from scipy import stats as scipy_stats
from scipy.stats import mannwhitneyu

from kbit_core.errors import StatisticsError

WHISKER_IQR_FACTOR = 1.5
CONFIDENCE = 0.95


@dataclass(frozen=True)
class BoxStats:
    """Statistics of one configuration's samples, keyed as the original's ``calculate_boxplot_stats`` output.

    ``variance``/``std_dev`` use ddof=1 and are 0.0 for a single sample (the original's ``utils`` copy; its
    ``benchmarks`` copy gave NaN). Whiskers are Tukey's: the most extreme samples inside the 1.5·IQR fences,
    never drawn inside the box (matplotlib's rule). ``olympic_mean`` drops one minimum and one maximum
    (MLPerf's scoring) and is the plain mean below three samples.
    """

    count: int
    q1: float
    median: float
    q3: float
    iqr: float
    lower_fence: float
    upper_fence: float
    lower_whisker: float
    upper_whisker: float
    lower_outliers: tuple[float, ...]
    upper_outliers: tuple[float, ...]
    mean: float
    variance: float
    std_dev: float
    min: float
    max: float
    olympic_mean: float
    median_ci_low: float
    median_ci_high: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lower_outliers"] = list(self.lower_outliers)
        d["upper_outliers"] = list(self.upper_outliers)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BoxStats:
        names = {f.name for f in fields(cls)}
        missing = names - data.keys()
        if missing:
            raise StatisticsError(f"statistics record lacks {sorted(missing)}")
        values = {k: data[k] for k in names}
        values["lower_outliers"] = tuple(values["lower_outliers"])
        values["upper_outliers"] = tuple(values["upper_outliers"])
        return cls(**values)


def checked_samples(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """``values`` as a float64 array; empty, NaN or infinite input is refused, naming the configuration."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size == 0:
        raise StatisticsError(f"no samples for configuration {name!r}")
    bad = ~np.isfinite(arr)
    if bad.any():
        where = np.flatnonzero(bad)[:5].tolist()
        raise StatisticsError(
            f"configuration {name!r} has {int(bad.sum())} non-finite sample(s) (NaN/inf) at positions {where}"
        )
    return arr


def olympic_mean(values: np.ndarray) -> float:
    """Mean after dropping one minimum and one maximum; the plain mean below three samples."""
    if values.size < 3:
        return float(values.mean())
    ordered = np.sort(values)
    return float(ordered[1:-1].mean())


def bootstrap_median_ci(
    values: np.ndarray, resamples: int, seed: int, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median, reproducible for a given seed.

    The percentile method, not BCa: BCa's acceleration estimate is undefined for tied or constant samples,
    which benchmark timings (rounded clocks, identical record counts) produce routinely.
    """
    if values.size < 2 or values.min() == values.max():
        v = float(np.median(values))
        return v, v
    res = scipy_stats.bootstrap(
        (values,),
        np.median,
        n_resamples=resamples,
        confidence_level=confidence,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def boxplot_stats(
    values: Sequence[float] | np.ndarray, *, name: str = "values", bootstrap_resamples: int = 2000, seed: int = 0
) -> BoxStats:
    """Compute :class:`BoxStats` of ``values`` (numpy linear percentiles, 1.5·IQR fences)."""
    x = checked_samples(values, name)
    q1, median, q3 = (float(v) for v in np.percentile(x, [25, 50, 75]))
    iqr = q3 - q1
    lower_fence, upper_fence = q1 - WHISKER_IQR_FACTOR * iqr, q3 + WHISKER_IQR_FACTOR * iqr
    inside = x[(x >= lower_fence) & (x <= upper_fence)]
    lower_whisker = min(float(inside.min()), q1) if inside.size else q1
    upper_whisker = max(float(inside.max()), q3) if inside.size else q3
    # Constant samples get an exact 0 (numpy leaves ~1e-32 of rounding from the mean).
    variance = float(x.var(ddof=1)) if x.size > 1 and x.min() != x.max() else 0.0
    ci_low, ci_high = bootstrap_median_ci(x, bootstrap_resamples, seed)
    return BoxStats(
        count=int(x.size),
        q1=q1,
        median=median,
        q3=q3,
        iqr=iqr,
        lower_fence=lower_fence,
        upper_fence=upper_fence,
        lower_whisker=lower_whisker,
        upper_whisker=upper_whisker,
        lower_outliers=tuple(float(v) for v in np.sort(x[x < lower_fence])),
        upper_outliers=tuple(float(v) for v in np.sort(x[x > upper_fence])),
        mean=float(x.mean()),
        variance=variance,
        std_dev=variance**0.5,
        min=float(x.min()),
        max=float(x.max()),
        olympic_mean=olympic_mean(x),
        median_ci_low=ci_low,
        median_ci_high=ci_high,
    )


def rate_median(
    amounts: Sequence[float] | np.ndarray,
    seconds: Sequence[float] | np.ndarray,
    *,
    name: str = "values",
    scale: float = 1.0,
) -> float:
    """Median of the per-sample rates ``amounts[i] / seconds[i] / scale`` (e.g. records/s, or MB/s with 1e6).

    The median of rates, not total/total: it stays paired with the median time of the same samples and is
    as robust to a straggling sample.
    """
    a = checked_samples(amounts, name)
    s = checked_samples(seconds, name)
    if a.shape != s.shape:
        raise StatisticsError(f"configuration {name!r}: {a.size} amounts but {s.size} durations")
    if (s <= 0).any():
        raise StatisticsError(f"configuration {name!r} has a non-positive duration; rates are undefined")
    return float(np.median(a / s / scale))


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Mann–Whitney U p-value: exact without ties, the normal approximation with them.

    Identical constant samples give 1.0, never NaN. Exact, unlike scipy's default above eight samples, so the
    smallest p a test of n_a vs n_b runs can give is :func:`smallest_mann_whitney_p`, as the docs state.
    """
    if np.intersect1d(a, b).size or np.unique(a).size < a.size or np.unique(b).size < b.size:
        return float(mannwhitneyu(a, b, alternative="two-sided", method="asymptotic").pvalue)
    return float(mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue)


def smallest_mann_whitney_p(n_a: int, n_b: int) -> float:
    """The smallest two-sided exact p of n_a vs n_b runs (complete separation): 2 / C(n_a + n_b, n_a)."""
    return min(1.0, 2 / comb(n_a + n_b, n_a))


def can_be_significant(n_a: int, n_b: int, tests: int, alpha: float) -> bool:
    """Whether n_a vs n_b runs can reach significance at ``alpha`` among ``tests`` Holm-corrected tests.

    Holm's strictest step divides alpha by the number of tests; a pair of run counts whose smallest possible
    p misses that can never support a claim, so it is reported as "insufficient runs", not as a p.
    """
    return smallest_mann_whitney_p(n_a, n_b) * max(tests, 1) < alpha


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (step-down, monotone, capped at 1), in the input order.

    Reject hypothesis i at family-wise level alpha when its adjusted p < alpha.
    """
    p = np.asarray(p_values, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()
