"""The retry policy: a second attempt only for faults a second attempt can fix."""

from __future__ import annotations

from typing import Any

import pytest
from prefect import task
from prefect.states import Failed
from prefect.task_engine import TaskRunTimeoutError

from kbit_core.errors import BrokerError, ConfigError
from tasks.policy import is_transient


@task
def _noop() -> None:
    return None


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (BrokerError("broker 127.0.0.1:1 unreachable"), True),
        (ConnectionRefusedError("refused"), True),
        (ConfigError("train.epochs: must be >= 1"), False),
        (TaskRunTimeoutError("Scope timed out after 3600 second(s)."), False),
        (ValueError("bad data"), False),
    ],
)
def test_only_transient_faults_are_retried(error: BaseException, retried: bool) -> None:
    failed: Any = Failed(data=error)
    assert is_transient(_noop, None, failed) is retried  # type: ignore[arg-type]
