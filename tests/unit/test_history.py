"""Benchmark history: change points on a step, none on flat noise, unstable configurations, commit ranges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kbit_core.bench.loading.history_files import write_history
from kbit_core.errors import StatisticsError
from kbit_core.stats.history import Night, analyze_history, history_markdown


def nights(levels: dict[str, list[float]], noise: float, seed: int) -> list[Night]:
    """Nights whose medians follow ``levels`` per configuration with relative (lognormal) noise; commit i per night."""
    rng = np.random.default_rng(seed)
    count = len(next(iter(levels.values())))
    out = []
    for i in range(count):
        medians = {}
        for name, series in levels.items():
            m = series[i] * rng.lognormal(0, noise)
            medians[name] = (m, m * 0.97, m * 1.03)
        out.append(Night(f"run{i}", f"2026-11-{i + 1:02d}T02:00+00:00", f"{i:07d}" + "0" * 33, medians))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_a_step_is_one_change_point_with_its_commit_range(seed: int) -> None:
    history = analyze_history(nights({"stepped": [1.0] * 10 + [1.5] * 10, "steady": [0.5] * 20}, 0.03, seed), 0.10)
    (change,) = history.change_points["stepped"]
    assert change.night == 10 and change.run_id == "run10" and change.started.startswith("2026-11-11")
    assert change.change_pct == pytest.approx(50, abs=8)
    assert change.commits == "000000900000..000001000000"
    assert "steady" not in history.change_points and not history.unstable
    assert "stepped +" in history.verdict() and "(000000900000..000001000000)" in history.verdict()


@pytest.mark.parametrize("seed", range(10))
def test_flat_noise_has_no_change_point(seed: int) -> None:
    history = analyze_history(nights({"flat": [1.0] * 30}, 0.03, seed), 0.10)
    assert history.change_points == {} and history.verdict().endswith("no change point.")


def test_a_noisy_configuration_is_flagged_unstable() -> None:
    history = analyze_history(
        nights({"noisy": [1.0] * 20, "quiet": [1.0] * 20}, 0.0, 0)[:0] + nights({"noisy": [1.0] * 20}, 0.15, 1), 0.10
    )
    (noisy,) = history.configurations
    assert noisy.unstable and noisy.noise_pct > 5
    assert "unstable: noisy" in history.verdict() and "**unstable**" in history_markdown(history)


def test_a_change_below_the_threshold_is_no_change_point() -> None:
    history = analyze_history(nights({"x": [1.0] * 10 + [1.05] * 10}, 0.0, 0), 0.10)
    assert history.change_points == {}


def test_few_nights_say_so_and_bad_medians_are_refused(tmp_path: Path) -> None:
    assert "2 night(s)" in analyze_history(nights({"x": [1.0, 2.0]}, 0.0, 0), 0.10).verdict()
    bad = [Night("r", "2026-11-01", "c", {"x": (0.0, 0.0, 0.0)})]
    with pytest.raises(StatisticsError, match="'x' has a non-positive"):
        analyze_history(bad, 0.10)


def test_history_files_are_written(tmp_path: Path) -> None:
    history = analyze_history(nights({"a": [1.0] * 6 + [2.0] * 6, "b": [1.0] * 12}, 0.02, 0), 0.10)
    files = write_history(history, tmp_path)
    assert files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert history.verdict() in files["table"].read_text()
    assert '"change_points"' in files["data"].read_text()
