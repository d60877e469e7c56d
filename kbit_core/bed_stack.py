"""The team stack on the test bed's driver host (`kbit cluster up --team-stack`): kbit's local stack with the team
profile (PostgreSQL, s3proxy, Prefect's and MLflow's servers behind kbit's login, a process worker) bound to the
driver's bed address, so the node hosts reach it and nothing outside the machine does, with its data under
``<bed_dir>/team``."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from kbit_core.config import KbitConfig, load_config
from kbit_core.service import Service
from kbit_core.stack import PROJECT_ROOT, LocalStack
from kbit_core.testbed.marked import MARKER_ENV
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.state import BedState, BedStatus, ProcessStatus, TeamStackState, load_state, state_path

TEAM_PROFILE = PROJECT_ROOT / "deployments" / "profiles" / "team.yaml"
# Apart from the local stack's defaults (4200, 5000, 5432, 8333), which a user's stack may hold on every interface.
TEAM_PORTS = {"prefect_port": 14200, "mlflow_port": 15000, "postgres_port": 15432, "s3_port": 18333}
WORK_POOL = "kbit-bed"


def team_workdir(bed_dir: Path) -> Path:
    """Where the bed's team stack keeps its data and logs; kept across `kbit cluster down`, as a team's database is."""
    return Path(bed_dir).resolve() / "team"


def team_config(state: BedState) -> KbitConfig:
    """The team profile on the driver's bed address and the bed's brokers (so no embedded broker starts)."""
    host = state.driver.address
    return load_config(TEAM_PROFILE).override(
        {
            "workdir": str(team_workdir(state.bed_dir)),
            "stack.host": host,
            "stack.work_pool": WORK_POOL,
            "tracking.tracking_uri": f"http://{host}:{TEAM_PORTS['mlflow_port']}",
            **{f"stack.{name}": port for name, port in TEAM_PORTS.items()},
            **state.kafka_overrides(),
        }
    )


def _services(stack: LocalStack) -> list[Service]:
    """The team stack's processes in stop order: the worker, the servers, then s3proxy and PostgreSQL."""
    return [stack.worker, stack.mlflow_server, stack.prefect_server, *reversed(stack.team.services)]


def team_stack(state: BedState) -> LocalStack:
    """The bed's team stack; its processes carry the bed's marker, so `down` stops them also after a crash."""
    stack = LocalStack(team_config(state))
    for service in _services(stack):
        service.env[MARKER_ENV] = str(Path(state.bed_dir).resolve())
    return stack


def _running_state(bed_dir: Path) -> BedState:
    state = load_state(Path(bed_dir).resolve())
    if state is None:
        raise TestbedError(f"no test bed is up at {bed_dir}: `kbit cluster up` first")
    return state


def _record(state: BedState, team: TeamStackState | None) -> BedState:
    state = state.model_copy(update={"team_stack": team})
    state_path(state.bed_dir).write_text(state.model_dump_json(indent=2))
    return state


def start(bed_dir: Path) -> BedState:
    """The running bed with its team stack started (what is not running yet) and recorded in its state."""
    state = _running_state(bed_dir)
    stack = team_stack(state)
    if state.team_stack is not None and all(svc.pid() is not None for svc in _services(stack)):
        return state
    started = time.monotonic()
    stack.up()
    team = TeamStackState(
        workdir=stack.run_dir,
        prefect_api_url=stack.prefect_api_url,
        mlflow_url=stack.mlflow_url,
        up_s=round(time.monotonic() - started, 1),
    )
    return _record(state, team)


def stop(bed_dir: Path) -> list[str]:
    """Stop the bed's team stack (its data stays under ``team_workdir``); the names that were running."""
    state = load_state(Path(bed_dir).resolve())
    if state is None or state.team_stack is None:
        return []
    stopped = team_stack(state).down()
    _record(state, None)
    return [f"process {name}" for name in stopped]


def shell_env(bed_dir: Path) -> dict[str, str]:
    """`kbit cluster team-env`: the exports that point the CLIs and kbit at the bed's team stack, logged in."""
    state = _running_state(bed_dir)
    if state.team_stack is None:
        raise TestbedError("this test bed runs no team stack: `kbit cluster up --team-stack`")
    return team_stack(state).shell_env()


def with_team_stack(bed: BedStatus) -> BedStatus:
    """The bed's status with the team stack's processes on the driver host; not up while one of them is down."""
    state = bed.state
    if state is None or state.team_stack is None:
        return bed
    driver = state.driver
    processes = [
        ProcessStatus(svc.name, driver.name, driver.address, svc.pid(), svc.pid() is not None, None, str(svc.log_path))
        for svc in _services(team_stack(state))
    ]
    return replace(bed, processes=[*bed.processes, *processes], up=bed.up and all(p.alive for p in processes))
