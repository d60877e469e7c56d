"""MLflow tracking against a real sqlite store in tmp_path: parent/child runs, metrics, artifacts, models."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from typer.testing import CliRunner

from kbit_core.bench.loading.report import STATS_JSON, timings_frame, write_report
from kbit_core.cli import app
from kbit_core.config import KbitConfig
from kbit_core.stats.identity import identity_hash
from kbit_core.tracking import (
    MlflowTracker,
    NoopTracker,
    final_metrics,
    make_tracker,
    previous_benchmark,
    record_overrides,
)
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.models import build_model
from tests.unit.test_identity import identity
from tests.unit.test_report import CONFIGS, synthetic_rows


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sqlite store for the module (creating its schema takes seconds); tests use their own experiments."""
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


def tracked_config(tmp_path: Path, store: Path, profile: str, **tracking: object) -> KbitConfig:
    return KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "kbit"),
            "profile": profile,
            "kafka": {
                "bootstrap_servers": "kafka.example:9092",
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "hunter2",
                "extra": {
                    "ssl.key.password": "also-secret",
                    "sasl.oauthbearer.config": "principal=alice clientSecret=OAUTHSECRET1",
                },
            },
            "tracking": {"tracking_uri": f"sqlite:///{store}", "system_metrics": False, **tracking},
        }
    )


def client_for(cfg: KbitConfig) -> MlflowClient:
    return MlflowClient(cfg.tracking_uri())


def test_benchmark_parent_and_children(tmp_path: Path, store: Path) -> None:
    flow_run = {"prefect.flow_run_url": "http://127.0.0.1:4200/flow-runs/flow-run/f1"}
    cfg = tracked_config(tmp_path, store, "bench", run_tags=flow_run)
    rows = synthetic_rows(iterations=3)
    files = write_report(timings_frame(rows), {"iterations": 3}, tmp_path / "report", bootstrap_resamples=100, seed=0)
    doc = json.loads(files.stats_json.read_text())
    tracker = make_tracker(cfg)
    assert isinstance(tracker, MlflowTracker)
    with tracker.run(cfg, name="bench", kind="benchmark") as parent_id:
        children = tracker.log_benchmark(parent_id, doc, rows, files.paths())

    client = client_for(cfg)
    exp = client.get_experiment_by_name("kbit-bench")
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.info.experiment_id == exp.experiment_id
    params = parent.data.params
    assert params["kafka.sasl_password"] != "hunter2" and params["kafka.extra.ssl.key.password"] == "***"
    assert [s for s in ("hunter2", "also-secret", "OAUTHSECRET1") if s in json.dumps(params)] == []
    assert params["bench.iterations"] == "30" and json.loads(params["bench.clients"]) == ["confluent"]
    # The benchmark's own settings: no optimizer, DeepSpeed or training-variant params that it never reads.
    assert params["train.global_batch_size"] == "64" and "produce.partitions" in params
    assert not any(k.startswith(("deepspeed.", "checkpoint.", "train.optim", "produce.variant")) for k in params)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on runs, not GenAI traces
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith(f"**Fastest: {CONFIGS[0]}, median makespan") and "1 insufficient runs" in note
    assert f"| 1 | {CONFIGS[0]} | 3 |" in note
    assert parent.data.tags["git_commit"] and "torch" in json.loads(parent.data.tags["versions"])
    assert parent.data.tags["fastest_configuration"] == CONFIGS[0]
    # The answer is the run's name and, with a link to the run, the top of the experiment's description.
    assert parent.info.run_name.startswith(
        f"fastest {CONFIGS[0]} "
    ) and "0 of 1 others significantly slower, 1 with too few runs to test" in (parent.info.run_name)
    latest, standing = exp.tags["mlflow.note.content"].split("\n\n---\n")
    assert latest.startswith(f"Fastest: {CONFIGS[0]}, median makespan") and latest.endswith(
        f"Latest benchmark: [bench](#/experiments/{exp.experiment_id}/runs/{parent_id}?workflowType=machine_learning)."
    )
    assert standing.startswith("kbit benchmarks of profile `bench`")
    # Only what the run read, rounded; the exact settings in config.json; the Prefect flow run it came from.
    assert not [k for k in params if k.startswith(("launch.ray_", "kafka.embedded.", "launch.task_gpu"))]
    assert params["shard.split_rates"] == "[0.8571, 0.07143, 0.07143]"
    exact = json.loads(Path(client.download_artifacts(parent_id, "config.json", str(tmp_path))).read_text())
    assert json.loads(exact["shard.split_rates"])[0] == 6 / 7 and exact["kafka.sasl_password"] == "***"
    assert parent.data.tags["prefect.flow_run_url"] == flow_run["prefect.flow_run_url"]

    found = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert {r.info.run_id for r in found} == set(children.values())
    child = client.get_run(children[CONFIGS[1]])
    assert child.data.tags["format"] == "json" and child.data.tags["compression"] == "none"
    value_size = doc["throughput"][CONFIGS[1]]["bytes_per_record"]
    assert child.data.tags["bytes_per_record"] == f"{value_size:,.0f} value, ? on the wire"  # no manifests here
    # A child spans what was measured of it (its rows' clock times), not the instant it was written.
    mine = [r for r in rows if r["config"] == child.data.tags["config"] and not r["warmup"]]
    assert child.info.start_time == int(min(r["started_unix_s"] for r in mine) * 1000)
    assert child.info.end_time == int(max(r["finished_unix_s"] for r in mine) * 1000)
    # Three iterations cannot support a significance claim: the runs table says so instead of showing a p.
    assert child.data.tags["vs_fastest"].endswith("× the fastest, insufficient runs for a test")
    makespan = doc["makespan"]["statistical_analysis"][CONFIGS[1]]["median"]
    assert child.info.run_name == f"{CONFIGS[1]} · {makespan:.3f} s · {child.data.tags['vs_fastest']}"
    fastest = client.get_run(children[CONFIGS[0]])
    assert fastest.data.tags["vs_fastest"] == "fastest" and "makespan_p_holm" not in fastest.data.metrics
    stats = doc["statistical_analysis"][CONFIGS[1]]
    assert child.data.metrics["per_rank_median_s"] == pytest.approx(stats["median"])
    assert child.data.metrics["per_rank_stats_count"] == 6 and child.data.metrics["makespan_stats_count"] == 3
    # The compare view opens on the first metric the store returns, and lists sort by name: both are the answer.
    assert min(child.data.metrics) == next(iter(child.data.metrics)) == "makespan_median_s"
    assert child.data.metrics["makespan_ratio_to_fastest"] > 1
    assert "throughput_records_per_s_median" in child.data.metrics
    history = client.get_metric_history(child.info.run_id, "makespan_s")
    assert sorted(m.step for m in history) == [0, 1, 2]  # warm-up iteration -1 is not logged
    assert len(client.get_metric_history(child.info.run_id, "rank1_load_s")) == 3
    assert len(client.get_metric_history(child.info.run_id, "rank_mean_s")) == 3

    artifacts = {a.path for a in client.list_artifacts(parent_id, "benchmark")}
    assert artifacts == {f"benchmark/{p.name}" for p in files.paths()}


def test_the_baseline_is_the_newest_comparable_run_without_measurement_overrides(tmp_path: Path, store: Path) -> None:
    cfg = tracked_config(tmp_path, store, "baseline")
    tracker = make_tracker(cfg)
    rows = synthetic_rows(iterations=3)

    def night(name: str, identity_changes: dict, overrides: dict | None) -> str:
        files = write_report(
            timings_frame(rows),
            {"identity": identity(identity_changes)},
            tmp_path / name,
            bootstrap_resamples=100,
            seed=0,
        )
        with tracker.run(cfg, name=name, kind="benchmark") as run_id:
            tracker.log_benchmark(run_id, json.loads(files.stats_json.read_text()), rows, files.paths())
        record_overrides(cfg, run_id, overrides)
        return run_id

    plain = night("plain", {}, {"workdir": str(tmp_path)})  # where it ran is no measurement override
    smaller = night("smaller", {"dataset.num_records": 20000}, None)
    overridden = night("overridden", {}, {"reader": {"prefetch_batches": 1}, "kafka": {"sasl_password": "pw"}})
    tonight = night("tonight", {}, None)

    found, passed_over = previous_benchmark(cfg, tonight, identity(), STATS_JSON)

    assert found is not None and found["run_id"] == plain
    assert found["stats"]["metadata"]["identity"] == identity()
    assert passed_over == [
        f'{overridden}: started with overrides {{"kafka.sasl_password": "***", "reader.prefetch_batches": "1"}}',
        f"{smaller}: differs in dataset.num_records: 20000 vs 70000",
    ]
    client = client_for(cfg)
    assert client.get_run(plain).data.tags["kbit.identity_hash"] == identity_hash(identity())
    assert client.get_run(smaller).data.tags["kbit.identity_hash"] != identity_hash(identity())


def test_kbit_history_draws_a_step_and_leaves_flat_noise_alone(tmp_path: Path, store: Path) -> None:
    """Twelve nights in a real store: one configuration gets 1.6× slower from night 6 on, the other stays flat."""
    cfg = tracked_config(tmp_path, store, "history")
    tracker, client = make_tracker(cfg), client_for(cfg)
    for night in range(12):
        rows = synthetic_rows(iterations=4, warmup=0, seed=night, slowdown={CONFIGS[1]: 1.6 if night >= 6 else 1.0})
        files = write_report(
            timings_frame(rows), {"identity": identity()}, tmp_path / f"night{night}", bootstrap_resamples=100, seed=0
        )
        with tracker.run(cfg, name=f"night{night}", kind="benchmark") as run_id:
            tracker.log_benchmark(run_id, json.loads(files.stats_json.read_text()), rows, [])
        record_overrides(cfg, run_id, None)
        client.set_tag(run_id, "git_commit", f"{night:02d}" * 20)
    # A last run with overrides is no night of the history.
    with tracker.run(cfg, name="tuned", kind="benchmark") as run_id:
        tracker.log_benchmark(run_id, json.loads(files.stats_json.read_text()), rows, [])
    record_overrides(cfg, run_id, {"reader": {"prefetch_batches": 1}})

    result = CliRunner().invoke(
        app,
        [
            "history",
            "--profile",
            "history",
            "--tracking-uri",
            cfg.tracking_uri(),
            "--out",
            str(tmp_path / "history"),
            "--json",
        ],
    )

    assert result.exit_code == 0, result.output
    history = json.loads(result.stdout)
    assert len(history["nights"]) == 12
    by_name = {c["name"]: c for c in history["configurations"]}
    (change,) = by_name[CONFIGS[1]]["change_points"]
    assert change["night"] == 6 and change["commits"] == f"{'05' * 6}..{'06' * 6}"
    assert change["change_pct"] == pytest.approx(60, abs=15)
    assert by_name[CONFIGS[0]]["change_points"] == []
    assert "1 run(s) started with overrides" in " ".join(history["left_out"])
    assert (tmp_path / "history" / "history.png").stat().st_size > 0


def test_a_failing_body_marks_the_run_failed(tmp_path: Path, store: Path) -> None:
    cfg = tracked_config(tmp_path, store, "failing")
    tracker = make_tracker(cfg)
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.run(cfg, name="bench", kind="benchmark") as run_id:
            raise RuntimeError("boom")
    assert client_for(cfg).get_run(run_id).info.status == "FAILED"


class OrchestratorTermination(BaseException):
    """Like Prefect's TerminationSignal on a flow-run cancellation: a BaseException, not an error."""


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OrchestratorTermination])
def test_a_stopped_body_marks_the_run_killed(tmp_path: Path, store: Path, stop: type[BaseException]) -> None:
    cfg = tracked_config(tmp_path, store, "stopped")
    with pytest.raises(stop):
        with make_tracker(cfg).run(cfg, name="train", kind="train") as run_id:
            raise stop()
    assert client_for(cfg).get_run(run_id).info.status == "KILLED"


def test_disabled_tracking_records_nothing(tmp_path: Path) -> None:
    cfg = tracked_config(tmp_path, tmp_path / "mlflow.db", "off", enabled=False)
    tracker = make_tracker(cfg)
    assert isinstance(tracker, NoopTracker)
    with tracker.run(cfg, name="train", kind="train") as run_id:
        tracker.log_training(run_id, {"history": [{"epoch": 0, "loss": 1.0}]})
    assert run_id is None
    assert not (tmp_path / "mlflow.db").exists()


def test_training_run_with_epochs_system_metrics_and_model(tmp_path: Path, store: Path) -> None:
    cfg = tracked_config(tmp_path, store, "train", system_metrics=True)
    cfg = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"model": cfg.train.model.model_copy(update={"name": "mlp"})})}
    )
    model = build_model(cfg.train.model, (1, 28, 28), 10)
    torch.save({"model": model.state_dict(), "epoch": 1}, tmp_path / "ckpt.pt")
    result = {
        "history": [
            {"epoch": 0, "train_loss": 2.0, "val_accuracy": 0.5, "steps": 10},
            {"epoch": 1, "train_loss": 1.0, "val_accuracy": 0.8, "steps": 20},
        ],
        "test_accuracy": 0.79,
        "samples_per_s": 1234.0,
        "steps": 20,
        "val_loss": [0.9, 0.7],
        "data": {
            "train": {"skipped_messages": 1, "padded_records": 1, "dropped_messages_per_epoch": 0},
            "test": {"skipped_messages": 0, "gaps": 2},
        },
    }
    tracker = make_tracker(cfg)
    with tracker.run(cfg, name="train", kind="train") as run_id:
        time.sleep(2.5)  # the training itself, long enough for system-metric samples at 1 s
        tracker.log_training(run_id, result, model_path=tmp_path / "ckpt.pt")

    client = client_for(cfg)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(0, 2.0), (1, 1.0)]
    assert run.data.metrics["test_accuracy"] == 0.79 and run.data.metrics["samples_per_s"] == 1234.0
    assert run.data.metrics["val/loss"] == 0.7  # a per-epoch list the history lacks: one point per epoch
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [0, 1]
    # Counts logged once are tags, not one-point charts.
    assert not [k for k in run.data.metrics if k.startswith("data") or k == "steps"]
    assert json.loads(run.data.tags["data.train"]) == result["data"]["train"] and run.data.tags["steps"] == "20"
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    import mlflow

    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert [m.source_run_id for m in models] == [run_id]
    loaded = mlflow.pytorch.load_model(models[0].model_uri)
    x = torch.rand(5, 1, 28, 28)
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_sharded_deepspeed_checkpoint_is_recorded_not_logged_as_model(tmp_path: Path, store: Path) -> None:
    cfg = tracked_config(tmp_path, store, "sharded")
    shards = tmp_path / "step-00000004"
    shards.mkdir()
    tracker = make_tracker(cfg)
    with tracker.run(cfg, name="train", kind="train") as run_id:
        tracker.log_training(run_id, {"history": [{"epoch": 0, "train_loss": 1.5}]}, model_path=shards)
    run = client_for(cfg).get_run(run_id)
    assert run.data.tags["model_logged"].startswith("no:") and run.data.metrics["train/loss"] == 1.5


def test_consolidated_deepspeed_checkpoint_is_logged_as_a_loadable_model(tmp_path: Path, store: Path) -> None:
    """The fp32 weights the ranks consolidate into a ZeRO checkpoint directory become the run's MLflow model."""
    cfg = tracked_config(tmp_path, store, "consolidated")
    model = build_model(cfg.train.model, (1, 28, 28), 10).eval()
    shards = tmp_path / "step-00000004"
    shards.mkdir()
    ckpt.write_consolidated(shards, model.state_dict())
    tracker = make_tracker(cfg)
    with tracker.run(cfg, name="train", kind="train") as run_id:
        tracker.log_training(run_id, {"history": [{"epoch": 0, "train_loss": 1.5}]}, model_path=shards)
    run = client_for(cfg).get_run(run_id)
    assert "model_logged" not in run.data.tags
    import mlflow

    # registered like a DDP run's model: the ZeRO-3 run's consolidated fp32 weights are what loads back
    (version,) = client_for(cfg).search_model_versions(f"run_id = '{run_id}'")
    assert version.name == "kbit-synthetic_digits-cnn" and version.tags["checkpoint"] == str(shards)
    loaded = mlflow.pytorch.load_model(f"models:/{version.name}/{version.version}")
    x = torch.rand(5, 1, 28, 28)
    torch.testing.assert_close(loaded(x), model(x))


def test_final_metrics_keep_numbers_last_epoch_values_and_data_counts() -> None:
    result = {
        "test_accuracy": 0.9,
        "steps": 12,
        "val_accuracy": [0.5, 0.8],
        "engine": "ddp",
        "checkpoint": None,
        "deterministic": True,
        "history": [{"epoch": 0, "val_accuracy": 0.5}],
        "val_loss": [],
        "data": {"val": {"skipped_messages": 3, "retries": 1}},
        # a user's train.metrics entry, top2: its test value and its per-epoch validation values
        "test_top2": 0.97,
        "val_top2": [0.9, 0.95],
        "pipeline_stages": 2,
    }
    assert final_metrics(result) == {
        "test_accuracy": 0.9,
        "steps": 12.0,
        "val_accuracy": 0.8,
        "test_top2": 0.97,
        "val_top2": 0.95,
        "pipeline_stages": 2.0,
        "data_val_skipped_messages": 3.0,
        "data_val_retries": 1.0,
    }


def test_a_run_left_running_by_a_killed_driver_is_marked_killed_by_the_next(tmp_path: Path, store: Path) -> None:
    """Issue 21 defect 11: SIGKILL of the driver (what the OOM killer does) left its MLflow run RUNNING for good."""
    cfg = tracked_config(tmp_path, store, "abandoned")
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kbit_core.config import KbitConfig; from kbit_core.tracking import make_tracker\n"
            "cfg = KbitConfig.from_json(sys.argv[1])\n"
            "with make_tracker(cfg).run(cfg, name='doomed', kind='train') as run_id:\n"
            "    print(run_id, flush=True); sys.stdin.read()",
            cfg.to_secret_json(),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    doomed = driver.stdout.readline().strip()
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    client = client_for(cfg)
    assert client.get_run(doomed).info.status == "RUNNING"

    with make_tracker(cfg).run(cfg, name="next", kind="train") as run_id:
        assert client.get_run(run_id).info.status == "RUNNING"  # its own driver lives: left alone
        ended = client.get_run(doomed)
        assert ended.info.status == "KILLED"
        assert (
            f"its driver {ended.data.tags['kbit.driver']} ended without ending it" in ended.data.tags["kbit.reconciled"]
        )
