"""Runs whose driver died without ending them (SIGKILL, the OOM killer): found and marked KILLED by the next run.

A run's ``kbit.driver`` tag names the process that drives it (:func:`kbit_core.service.owner_token`); a run still
RUNNING whose driver on this host is gone can never finish, so it is ended as KILLED, saying why.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kbit_core.service import owner_gone

log = logging.getLogger(__name__)

DRIVER_TAG = "kbit.driver"
RECONCILED_TAG = "kbit.reconciled"


def end_abandoned_runs(client: Any, experiment_id: str) -> list[str]:
    """Mark KILLED every RUNNING run of ``experiment_id`` whose driver process on this host is gone; their ids."""
    running = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=200)
    ended = []
    for run in running:
        driver = run.data.tags.get(DRIVER_TAG)
        if driver is None or not owner_gone(driver):
            continue
        client.set_tag(
            run.info.run_id,
            RECONCILED_TAG,
            f"marked KILLED at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: its driver {driver} ended without ending it "
            "(SIGKILL or the OOM killer)",
        )
        client.set_terminated(run.info.run_id, status="KILLED")
        log.warning(
            "MLflow run %s was left RUNNING by driver %s, which is gone; marked it KILLED", run.info.run_id, driver
        )
        ended.append(run.info.run_id)
    return ended
