"""The streaming benchmark's verdicts from a trainer history: sustained stages, the producer's bound, freshness."""

from __future__ import annotations

from typing import Any

import pytest

from kbit_core.jobs.stream_bench import _analyse
from kbit_core.stream.report import summary_markdown


def window(t: float, records: int, lag: int, fresh: float = 0.2, lag_s: float = 0.1) -> dict[str, Any]:
    return {
        "step": int(t),
        "wall_time": t,
        "records": records,
        "lag_records": lag,
        "lag_seconds": lag_s,
        "records_per_s": 0.0,
        "train_loss": 1.0,
        "freshness_p50_s": fresh,
        "freshness_p95_s": fresh * 2,
        "freshness_p99_s": fresh * 3,
    }


STAGES = [
    {"rate": 100, "start": 0, "end": 10, "produced": 1000},
    {"rate": 1000, "start": 10, "end": 20, "produced": 10_000},
    {"rate": 2000, "start": 20, "end": 30, "produced": 20_000},
    {"rate": 4000, "start": 30, "end": 40, "produced": 25_000},
]


def test_the_answer_is_the_last_stage_before_the_lag_runs_away() -> None:
    history = [
        window(1, 0, 900, fresh=9.0, lag_s=9.0),
        window(5, 600, 0, fresh=0.3),
        window(9, 1000, 0, fresh=0.5),
        window(11, 1000, 0),
        window(19, 9000, 50),  # 1000/s kept up
        window(21, 11000, 0),
        window(29, 18000, 2000),  # 2000/s: trained 875/s, lag grew: not sustained
        window(31, 19000, 3000),
        window(39, 21000, 9000),
    ]
    result = _analyse(history, STAGES, fixed_rate=100)
    assert [s["sustained"] for s in result["stages"]] == [True, True, False, False]
    assert result["max_sustained_rate"] == 1000 and not result["producer_limited"]
    # freshness only from the fixed-rate stage's windows that had caught up (lag under a second)
    assert result["freshness_s"] == pytest.approx({"p50": 0.4, "p95": 0.8, "p99": 1.2})
    assert result["stages"][3]["producer_limited"]  # 2500/s achieved of 4000/s asked


def test_a_stage_with_too_few_windows_has_no_verdict() -> None:
    result = _analyse([window(12, 0, 0)], STAGES[:2], fixed_rate=100)
    assert result["stages"][1]["sustained"] is None and result["max_sustained_rate"] is None


def test_the_artifact_opens_on_the_headline_and_lists_warnings() -> None:
    result = {
        "topic": "t",
        "records_this_run": 1200,
        "seconds": 10.0,
        "records_per_s": 120.0,
        "world_size": 2,
        "stop_reason": "idle",
        "test_accuracy": 0.93,
        "freshness_s": {"p50": 0.2, "p95": 0.4, "p99": 0.5},
        "lag_records": 3,
        "lag_seconds": 0.1,
        "resets": 1,
        "lag_warnings": ["lag grows without bound: x"],
        "history": [window(10, 640, 3)],
    }
    text = summary_markdown(result)
    assert "**1,200 records in 10.0 s (120 records/s) on 2 rank(s); stopped: idle; test accuracy 0.9300**" in text
    assert "> **warning:** lag grows without bound: x" in text and "| 10 | 640 |" in text
