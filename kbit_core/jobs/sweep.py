"""Hyperparameter sweeps on Ray Tune: the Prefect sweep's trials and objective, with ASHA stopping the weak ones early.

Each trial is one point of :func:`kbit_core.trials.expand_space` (so both backends try the same points) trained by
Ray Train (``launch.engine=ray``). A trial advances one epoch per ASHA rung: rung ``k`` resumes from the trial's
epoch-``k-1`` checkpoint (kbit's own, loader state included) and trains to epoch ``k``, so a trial that runs every
rung trains exactly as one uninterrupted run does, and a stopped one costs only the epochs it ran. The driver
records one MLflow parent run for the sweep and one child run per trial, and picks the best trial with
:func:`kbit_core.trials.best_trial`, as the Prefect sweep does.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Literal

from kbit_core import handoff
from kbit_core.brokers.local import embedded_broker
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.launch import launch
from kbit_core.launch.ray_train import ensure_ray
from kbit_core.produce import produce_dataset
from kbit_core.tracking import final_metrics, make_tracker
from kbit_core.train.worker import train_main
from kbit_core.trials import DEFAULT_SPACE, best_trial, expand_space

log = logging.getLogger(__name__)

# The rung results report this key with the kbit result as hand-off JSON, so the driver gets the history it logs.
_RESULT_KEY = "kbit_result"
# LR schedules computed from the run's total steps: training to epoch k of a shorter run would change them.
_TOTAL_STEP_SCHEDULES = ("cosine", "onecycle")


def tune_sweep(
    cfg: KbitConfig,
    space: dict[str, list[Any]] | None = None,
    num_trials: int | None = None,
    metric: str = "val_accuracy",
    mode: Literal["max", "min"] = "max",
    seed: int = 0,
) -> dict[str, Any]:
    """Run the sweep on Ray Tune with ASHA; return ``{"best", "trials", "mlflow_run_id"}`` like the Prefect sweep.

    Each trial in ``trials`` holds ``trial``, ``params``, ``metrics`` (the last epoch's, as the Prefect sweep
    reports them), ``epochs`` (how many it ran before ASHA stopped it or it finished), ``ranks`` (where its last
    rung's ranks ran: rank, host, address) and ``mlflow_run_id``.

    Raises:
        ConfigError: ``launch.engine`` is not ``ray``, a schedule depends on the total step count, or a trial
            point is not a valid config.
    """
    trials = expand_space(space or DEFAULT_SPACE, num_trials, seed)
    configs = [cfg.override(trial) for trial in trials]
    for trial_cfg in configs:
        _check(trial_cfg)
    sweep_dir = cfg.run_dir / "tune" / f"sweep-{uuid.uuid4().hex[:8]}"
    tracker = make_tracker(cfg)
    with (
        embedded_broker(cfg),
        tracker.run(
            cfg, name=f"sweep-{cfg.profile}", kind="sweep", tags={"kbit.sweep_backend": "ray-tune"}
        ) as parent_id,
    ):
        manifests = [produce_dataset(trial_cfg, progress=False).model_dump_json() for trial_cfg in configs]
        reports = _run_tuner(cfg, configs, manifests, sweep_dir, metric, mode)
        results = [
            {
                "trial": index,
                "params": trial,
                "metrics": final_metrics(report),
                "epochs": report["epochs"],
                "ranks": report["ranks"],
            }
            for index, (trial, report) in enumerate(zip(trials, reports))
        ]
        best = best_trial(results, metric, mode)
        for result, trial_cfg, report in zip(results, configs, reports):
            tags = {
                "mlflow.parentRunId": parent_id or "",
                "kbit.trial": str(result["trial"]),
                "kbit.best_trial": str(result is best).lower(),
                "kbit.epochs_run": str(result["epochs"]),
            }
            with tracker.run(trial_cfg, name=f"trial-{result['trial']}", kind="train", tags=tags) as child_id:
                tracker.log_training(child_id, report)
            result["mlflow_run_id"] = child_id
    log.info(
        "ray-tune sweep: best trial %d %s with %s=%.4g", best["trial"], best["params"], metric, best["metrics"][metric]
    )
    return {"best": best, "trials": results, "mlflow_run_id": parent_id}


def _check(cfg: KbitConfig) -> None:
    if cfg.launch.engine != "ray":
        raise ConfigError(
            f"sweep.backend=ray-tune trains with Ray Train: set launch.engine=ray (it is {cfg.launch.engine!r})"
        )
    if cfg.train.optim.schedule in _TOTAL_STEP_SCHEDULES:
        raise ConfigError(
            f"sweep.backend=ray-tune trains a trial one epoch per ASHA rung, which changes the "
            f"train.optim.schedule={cfg.train.optim.schedule!r} learning rates; use constant or step, "
            f"or sweep.backend=prefect"
        )


def _run_tuner(
    cfg: KbitConfig, configs: list[KbitConfig], manifests: list[str], sweep_dir: Path, metric: str, mode: str
) -> list[dict[str, Any]]:
    """Every trial's last rung result (the kbit training result), in trial order."""
    ensure_ray(cfg)  # first: Ray reads its environment at import
    # the `ray` extra: optional, and seconds to import
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    trainable = tune.with_parameters(
        _trial, configs=[c.to_secret_json() for c in configs], manifests=manifests, sweep_dir=str(sweep_dir)
    )
    scheduler = ASHAScheduler(
        time_attr="epoch",
        max_t=cfg.train.epochs,
        grace_period=cfg.sweep.grace_epochs,
        reduction_factor=cfg.sweep.reduction_factor,
    )
    tuner = tune.Tuner(
        # The trial itself only waits on its Ray Train job, whose workers hold the CPUs; Tune needs some
        # resource to place it, so it holds a token amount of memory and no CPU.
        tune.with_resources(trainable, {"CPU": 0, "memory": 2**20}),
        param_space={"trial": tune.grid_search(list(range(len(configs))))},
        tune_config=tune.TuneConfig(metric=metric, mode=mode, scheduler=scheduler, max_concurrent_trials=1),
        run_config=tune.RunConfig(name=sweep_dir.name, storage_path=str(sweep_dir.parent)),
    )
    grid = tuner.fit()
    reports: dict[int, dict[str, Any]] = {}
    for result in grid:
        if result.error is not None:
            raise result.error
        reports[result.config["trial"]] = handoff.loads(result.metrics[_RESULT_KEY])
    return [reports[index] for index in range(len(configs))]


def _trial(params: dict[str, Any], *, configs: list[str], manifests: list[str], sweep_dir: str) -> None:
    """One Tune trial: train one more epoch per rung (resuming kbit's checkpoint) and report its metrics."""
    # the `ray` extra: optional, and seconds to import
    from ray import tune

    index = params["trial"]
    run_dir = Path(sweep_dir) / f"trial-{index}"
    cfg = _trial_config(KbitConfig.from_json(configs[index]), run_dir)
    resume = "none"
    for epoch in range(1, cfg.train.epochs + 1):
        # The previous rung finished its run, so its last (epoch-end) checkpoint is resumed by path.
        result = launch(
            train_main,
            cfg.override({"train.epochs": epoch, "checkpoint.resume": resume}),
            manifests[index],
            str(run_dir),
        )
        resume = result["checkpoint"]
        tune.report({"epoch": epoch, **final_metrics(result), _RESULT_KEY: handoff.dumps(result)})


def _trial_config(cfg: KbitConfig, run_dir: Path) -> KbitConfig:
    """The trial's config: its own run directory, and epoch checkpoints there for the next rung to resume."""
    return cfg.override(
        {
            "workdir": str(run_dir),
            "tracking.enabled": False,
            "checkpoint": {"dir": str(run_dir / "checkpoints"), "every_epoch": True},
        }
    )
