"""The benchmark history job: the nightly medians of a profile from MLflow, analysed and written out."""

from __future__ import annotations

from pathlib import Path

from kbit_core.bench.loading.history_files import write_history
from kbit_core.config import KbitConfig
from kbit_core.stats.history import History, analyze_history
from kbit_core.tracking import benchmark_nights


def history_report(
    cfg: KbitConfig, out_dir: Path, last: int | None = None
) -> tuple[History, dict[str, Path], list[str]]:
    """The history of ``cfg``'s profile from its MLflow experiment (the newest run's identity, override-free
    runs only, at most ``last`` nights), written to ``out_dir``; also what was left out and why."""
    nights, left_out = benchmark_nights(cfg, last)
    history = analyze_history(nights, cfg.bench.regression_threshold)
    return history, write_history(history, out_dir), left_out
