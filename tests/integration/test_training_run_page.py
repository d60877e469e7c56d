"""What a user sees of one real training run in MLflow (a sqlite store in tmp): curves first, facts as tags, the
result atop the description, the artifacts, and a registered model that loads back and serves."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from kbit_core.config import KbitConfig, deep_merge
from kbit_core.data.split_loaders import make_split_loader
from kbit_core.jobs.train import train
from kbit_core.kafka.manifest import Manifest
from kbit_core.tracking import registered_model_name
from tests.conftest import SMALL_TRAINING, embedded_settings, free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# The charts of these sections open the run's Model metrics tab (MLflow sorts named sections first, alphabetically).
CURVES = ("train/accuracy", "train/loss", "train/step_loss", "val/accuracy", "val/loss")
SERVE_START_S = 180  # mlflow models serve imports mlflow and torch before it answers /ping: slow on 2 busy cores


@pytest.fixture(scope="module")
def trained(broker: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[KbitConfig, dict[str, Any]]:
    """One small tracked training run (2 ranks under torchrun, 2 epochs) shared by the module's tests."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = KbitConfig.from_dict(
        deep_merge(
            copy.deepcopy(SMALL_TRAINING),
            {
                "workdir": str(tmp / "kbit"),
                "kafka": {"embedded": embedded_settings(broker)},
                "dataset": {"num_records": 1200},
                "produce": {"topic_prefix": f"test{uuid.uuid4().hex[:8]}"},
                "train": {"epochs": 2, "model": {"name": "cnn"}},
                "checkpoint": {"dir": "checkpoints", "every_epoch": True},
                "launch": {"engine": "torchrun", "num_processes": 2},
                "tracking": {
                    "enabled": True,
                    "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                    "system_metrics": False,
                },
            },
        )
    )
    result = train(cfg, progress=False)
    assert "tracking_error" not in result, result["tracking_error"]
    return cfg, result


def chart_sections(metric_keys: list[str]) -> list[tuple[str, list[str]]]:
    """MLflow 3.17's run page layout: sections by the name before the last '/', named ones sorted, then the unnamed
    'Model metrics'; charts sorted by key within a section (getBaseChartAndSectionConfigs in the UI's bundle)."""
    sections: dict[str, list[str]] = {}
    for key in sorted(metric_keys):
        sections.setdefault(key.rpartition("/")[0], []).append(key)
    return [(name, sections[name]) for name in sorted(s for s in sections if s)] + [("", sections.get("", []))]


def test_the_run_opens_on_its_curves_and_says_what_it_trained(trained: tuple[KbitConfig, dict[str, Any]]) -> None:
    cfg, result = trained
    client = MlflowClient(cfg.tracking_uri())
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.run_name == "synthetic_digits-cnn-raw_bytes_lz4-2r"
    metrics = run.data.metrics
    sections = chart_sections(list(metrics))
    assert [name for name, _ in sections[:2]] == ["train", "val"]
    assert [key for _, keys in sections[:2] for key in keys] == list(CURVES)
    # Every curve has a point per epoch (the per-step loss one per optimizer step); the only one-point metrics are
    # the results a run is compared by.
    points = {key: len(client.get_metric_history(run.info.run_id, key)) for key in metrics}
    assert points["train/loss"] == points["val/accuracy"] == 2 and points["train/step_loss"] == result["steps"]
    one_point = sorted(key for key, n in points.items() if n == 1)
    assert one_point == [
        "data_wait_fraction",
        "peak_memory_mb",
        "samples_per_s",
        "test_accuracy",
        "test_loss",
        "wall_seconds",
    ]
    assert metrics["test_accuracy"] == pytest.approx(result["test_accuracy"])
    assert metrics["val/accuracy"] == pytest.approx(result["val_accuracy"][-1])
    # The constants that used to be one-point charts are tags.
    tags = run.data.tags
    assert not {"world_size", "data_parallel_size", "epochs", "restarts"} & set(metrics)
    assert not [key for key in metrics if key.startswith("data_test_")]
    assert tags["world_size"] == "2" and tags["data_parallel_size"] == "2" and tags["epochs"] == "2"
    assert json.loads(tags["data.test"])["skipped_messages"] == 0
    note = tags["mlflow.note.content"]
    first = note.splitlines()[0]
    assert first.startswith(f"**test accuracy {result['test_accuracy']:.4f}** · ") and "samples/s on 2 ranks" in first
    assert "% of step time waiting for data, 0 messages skipped" in first
    assert f"`{registered_model_name(cfg)}` version" in note
    # The experiment's description, atop every view of it, links the newest training's curves: the second click
    # from MLflow's landing page.
    experiment = client.get_experiment(run.info.experiment_id)
    link = (
        f"#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics?workflowType=machine_learning"
    )
    latest = experiment.tags["mlflow.note.content"].split("\n\n---\n")[0]
    assert latest.startswith(f"[Latest training: {run.info.run_name}]({link}): **test accuracy ")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "loss_curve.png", "run_report.json", "manifests"} <= artifacts
    manifests = {a.path for a in client.list_artifacts(run.info.run_id, "manifests")}
    assert manifests == {f"manifests/{result['topic']}.json"}
    # beside the sqlite store, not in the directory the test ran in
    store_dir = Path(cfg.tracking_uri().removeprefix("sqlite:///")).parent
    assert client.get_experiment(run.info.experiment_id).artifact_location == (store_dir / "mlruns").as_uri()


def test_the_registered_model_predicts_the_test_split_with_the_runs_accuracy(
    trained: tuple[KbitConfig, dict[str, Any]],
) -> None:
    cfg, result = trained
    client = MlflowClient(cfg.tracking_uri())
    name = registered_model_name(cfg)
    assert name == "kbit-synthetic_digits-cnn"
    (version,) = client.search_model_versions(f"name = '{name}'")
    manifest_file = Path(result["manifest_path"])
    manifest = Manifest.load(manifest_file)
    assert version.run_id == result["mlflow_run_id"]
    assert version.tags["topic"] == result["topic"] == manifest.topic
    assert version.tags["offsets"] == ",".join(manifest.offset_strings())
    assert version.tags["manifest_sha256"] == hashlib.sha256(manifest_file.read_bytes()).hexdigest()
    mlflow.set_tracking_uri(cfg.tracking_uri())
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version.version}")
    assert model.metadata.signature is not None and model.metadata.saved_input_example_info is not None
    correct = total = 0
    with make_split_loader(cfg, manifest, "test", rank=0, world_size=1) as loader:
        for x, y in loader:
            predicted = model.predict(x.numpy()).argmax(axis=1)
            correct += int((predicted == y.numpy()).sum())
            total += len(y)
    assert total == 120  # the test split's 10 % of the 1200 records
    assert correct / total == pytest.approx(result["test_accuracy"], abs=1e-9)


def test_mlflow_models_serve_answers_a_request(trained: tuple[KbitConfig, dict[str, Any]], tmp_path: Path) -> None:
    cfg, _ = trained
    name, port = registered_model_name(cfg), free_port()
    uri = f"models:/{name}/1"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local"]
        + ["-h", "127.0.0.1", "-p", str(port), "--workers", "1"],
        # the venv's bin on PATH, as an activated venv has it: the server runs its uvicorn
        env={
            **os.environ,
            "MLFLOW_TRACKING_URI": cfg.tracking_uri(),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the server's workers go with it
    )
    try:
        deadline = time.monotonic() + SERVE_START_S
        while not _answers(f"http://127.0.0.1:{port}/ping"):
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no answer in {SERVE_START_S} s"
            time.sleep(1)
        images = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps({"inputs": images.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            served = np.asarray(json.loads(response.read())["predictions"])
        mlflow.set_tracking_uri(cfg.tracking_uri())
        local = mlflow.pyfunc.load_model(uri).predict(images)
        np.testing.assert_allclose(served, local, rtol=1e-4, atol=1e-5)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
