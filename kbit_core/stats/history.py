"""Benchmark history: each configuration's nightly median with its CI, change points, unstable configurations.

A night is one finished benchmark run of one identity (``stats.identity``) started without measurement
overrides. Per configuration, the series of nightly median makespans is searched for level shifts with
ruptures' PELT (least-squares cost on the log of the medians, so a change is relative), scaled by a robust
estimate of the night-to-night noise (the MAD of successive differences, which a single step barely moves).
A shift is reported as a change point only when its segments' medians also differ by at least the regression
threshold, and it names the commit range between the last night before it and the first night after.
A configuration whose nights scatter by more than half the threshold (robust σ) is flagged unstable: a
threshold-sized change is then within two σ of noise and cannot be told from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kbit_core.errors import StatisticsError

# Nights on each side of a change: one night alone is an outlier, two a coincidence of a shared machine's load.
MIN_SEGMENT = 3
PENALTY_PER_LOG_NIGHT = 3.0  # PELT penalty = 3·ln(n) in units of the noise variance (a conservative BIC)
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Night:
    """One benchmark run: when, at which commit, and each configuration's median makespan with its 95 % CI."""

    run_id: str
    started: str
    commit: str
    medians: Mapping[str, tuple[float, float, float]]  # configuration -> (median, ci_low, ci_high) seconds


@dataclass(frozen=True)
class ChangePoint:
    """A level shift: the first night at the new level, the medians of the levels, and the commits between."""

    night: int
    run_id: str
    started: str
    before_s: float
    after_s: float
    change_pct: float
    commits: str


@dataclass(frozen=True)
class ConfigHistory:
    name: str
    nights: tuple[int, ...]
    medians: tuple[float, ...]
    ci_low: tuple[float, ...]
    ci_high: tuple[float, ...]
    noise_pct: float | None
    unstable: bool
    change_points: tuple[ChangePoint, ...]


@dataclass(frozen=True)
class History:
    nights: tuple[Night, ...]
    threshold: float
    configurations: tuple[ConfigHistory, ...]

    @property
    def change_points(self) -> dict[str, tuple[ChangePoint, ...]]:
        return {c.name: c.change_points for c in self.configurations if c.change_points}

    @property
    def unstable(self) -> list[str]:
        return [c.name for c in self.configurations if c.unstable]

    def verdict(self) -> str:
        """One sentence: how many nights, which configurations changed level (with commits), which are unstable."""
        if len(self.nights) < 2 * MIN_SEGMENT:
            return (
                f"History: {len(self.nights)} night(s) of this identity; change points need at least {2 * MIN_SEGMENT}."
            )
        changes = [
            f"{name} {cp.change_pct:+.0f}% at {cp.started[:10]} ({cp.commits})"
            for name, cps in self.change_points.items()
            for cp in cps
        ]
        text = f"History over {len(self.nights)} nights since {self.nights[0].started[:10]}: "
        text += ("change points in " + "; ".join(changes)) if changes else "no change point"
        if self.unstable:
            text += f"; unstable: {', '.join(self.unstable)}"
        return text + "."

    def to_dict(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "verdict": self.verdict(),
            "nights": [{**asdict(n), "medians": {k: list(v) for k, v in n.medians.items()}} for n in self.nights],
            "configurations": [asdict(c) for c in self.configurations],
        }


def noise_sigma(log_medians: np.ndarray) -> float:
    """Robust σ of the night-to-night noise on the log scale: MAD of successive differences / √2."""
    diffs = np.diff(log_medians)
    return float(MAD_TO_SIGMA * np.median(np.abs(diffs - np.median(diffs))) / np.sqrt(2)) if diffs.size else 0.0


def level_shifts(log_medians: np.ndarray, sigma: float) -> list[int]:
    """Indices where a new level starts (PELT, least squares on the noise-scaled series); [] if too short."""
    # ruptures loads only for the change-point analysis
    import ruptures

    n = log_medians.size
    if n < 2 * MIN_SEGMENT:
        return []
    # A flat series (σ = 0) has no noise to scale by: any change in it is exact, so a tiny σ keeps it visible.
    scaled = log_medians / max(sigma, 1e-9)
    breaks = (
        ruptures.Pelt(model="l2", min_size=MIN_SEGMENT, jump=1)
        .fit(scaled.reshape(-1, 1))
        .predict(pen=PENALTY_PER_LOG_NIGHT * np.log(n))
    )
    return [b for b in breaks if b < n]


def commit_range(before: Night, after: Night) -> str:
    """'abc1234..def5678' between the nights' commits (the same commit twice: the change is not in the code)."""
    a, b = before.commit[:12], after.commit[:12]
    return f"{a}..{b}" if a != b else f"{a} (same commit: not a code change)"


def analyze_history(nights: Sequence[Night], threshold: float) -> History:
    """Change points and stability of every configuration over ``nights`` (oldest first)."""
    if threshold <= 0:
        raise StatisticsError(f"history threshold must be positive, got {threshold}")
    names = list(dict.fromkeys(name for night in nights for name in night.medians))
    configurations = []
    for name in names:
        present = [i for i, night in enumerate(nights) if name in night.medians]
        values = np.array([nights[i].medians[name] for i in present], dtype=np.float64).reshape(-1, 3)
        if (values[:, 0] <= 0).any() or not np.isfinite(values).all():
            raise StatisticsError(f"configuration {name!r} has a non-positive or non-finite nightly median")
        logs = np.log(values[:, 0])
        sigma = noise_sigma(logs)
        bounds = [0, *level_shifts(logs, sigma), len(present)]
        changes = []
        for level_start, start, stop in zip(bounds, bounds[1:-1], bounds[2:]):
            before = float(np.median(values[level_start:start, 0]))
            after = float(np.median(values[start:stop, 0]))
            if abs(after / before - 1) >= threshold:
                night = present[start]
                changes.append(
                    ChangePoint(
                        night=night,
                        run_id=nights[night].run_id,
                        started=nights[night].started,
                        before_s=before,
                        after_s=after,
                        change_pct=(after / before - 1) * 100,
                        commits=commit_range(nights[present[start - 1]], nights[night]),
                    )
                )
        noise_pct = (float(np.expm1(sigma)) * 100) if len(present) >= 3 else None
        configurations.append(
            ConfigHistory(
                name=name,
                nights=tuple(present),
                medians=tuple(values[:, 0]),
                ci_low=tuple(values[:, 1]),
                ci_high=tuple(values[:, 2]),
                noise_pct=noise_pct,
                unstable=noise_pct is not None and noise_pct > threshold * 100 / 2,
                change_points=tuple(changes),
            )
        )
    return History(nights=tuple(nights), threshold=threshold, configurations=tuple(configurations))


def history_markdown(history: History) -> str:
    """One row per configuration: nights, latest median with CI, noise, change points."""
    lines = [
        "| configuration | nights | latest median s [95% CI] | noise | change points (first night, change, commits) |",
        "|---|---|---|---|---|",
    ]
    for c in history.configurations:
        noise = "–" if c.noise_pct is None else f"{c.noise_pct:.1f}%" + (" **unstable**" if c.unstable else "")
        changes = "; ".join(f"{cp.started[:10]} {cp.change_pct:+.0f}% ({cp.commits})" for cp in c.change_points)
        lines.append(
            f"| {c.name} | {len(c.nights)} | {c.medians[-1]:.4f} [{c.ci_low[-1]:.4f}, {c.ci_high[-1]:.4f}] "
            f"| {noise} | {changes or 'none'} |"
        )
    return "\n".join(lines) + "\n"
