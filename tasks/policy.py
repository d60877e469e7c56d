"""Retry and caching policy shared by the tasks: retry only what a second attempt can fix."""

from __future__ import annotations

import sys
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun
from prefect.task_engine import TaskRunTimeoutError

from kbit_core.errors import BrokerError

# A broker that is starting, restarting or briefly unreachable; never bad config or bad data.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (BrokerError, ConnectionError, TimeoutError)

# Exponential backoff between attempts of network steps, in seconds.
BACKOFF_S = [2, 8, 30]


def is_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """retry_condition_fn: retry only when the attempt failed with a transient fault."""
    try:
        state.result()
    except TaskRunTimeoutError:
        return False  # the task's own time limit ran out: another attempt would only take as long again
    except TRANSIENT_ERRORS:
        return True
    except BaseException:
        return False
    return False


def show_progress() -> bool:
    """Progress bars on a terminal only: under a worker they would fill the flow-run log with redraws."""
    return sys.stderr.isatty()
