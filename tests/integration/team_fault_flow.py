"""A Prefect flow that logs an MLflow run through kbit's tracker in two steps, each a metric, a param and an artifact,
and waits between them for a gate file: what the team stack's fault tests break a server under.

Run as ``python team_fault_flow.py CONFIG_JSON GATE``: it writes ``GATE.ready`` (the MLflow run, flow run and
experiment ids, as JSON) once the first step is stored, and goes on when ``GATE`` exists."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from prefect import flow, runtime, task

from kbit_core.config import KbitConfig
from kbit_core.tracking import MlflowTracker, make_tracker
from kbit_core.tracking.artifacts import storing

GATE_TIMEOUT_S = 600.0


@task
def log_step(tracker: MlflowTracker, run_id: str, step: int, folder: Path) -> None:
    artifact = folder / f"step{step}.txt"
    artifact.write_text(f"step {step}\n" * 100)
    tracker.client.log_metric(run_id, "step", step, step=step)
    tracker.client.log_param(run_id, f"step{step}", str(step))
    with storing(tracker.cfg, run_id, artifact.name):  # as kbit's tracker stores its artifacts
        tracker.client.log_artifact(run_id, str(artifact))


def wait_for(gate: Path) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {gate} within {GATE_TIMEOUT_S:.0f}s")
        time.sleep(0.2)


@flow(name="kbit-team-fault")
def two_steps(config_json: str, gate: str) -> str:
    cfg = KbitConfig.from_dict(json.loads(Path(config_json).read_text()))
    tracker = make_tracker(cfg)
    gate_path = Path(gate)
    with tracker.run(cfg, name="team-fault", kind="train") as run_id:
        log_step(tracker, run_id, 0, gate_path.parent)
        ids = {"run_id": run_id, "flow_run_id": str(runtime.flow_run.id), "experiment_id": tracker.experiment_id}
        gate_path.with_suffix(".ready").write_text(json.dumps(ids))
        wait_for(gate_path)
        log_step(tracker, run_id, 1, gate_path.parent)
    return run_id


if __name__ == "__main__":
    two_steps(sys.argv[1], sys.argv[2])
