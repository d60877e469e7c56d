"""Profiles and prefect.yaml, checked without a server: every profile validates, every deployment points at a
real flow with parameters it accepts, and the nightly one carries its cron schedule."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from kbit_core.config import COMPRESSIONS, FORMATS, load_config
from kbit_core.errors import ConfigError
from kbit_core.formats import supported
from kbit_core.stack import PROJECT_ROOT
from tasks.config import load_run_config, profile_path

PREFECT_YAML = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = {f"{d['entrypoint'].rsplit(':', 1)[1]}/{d['name']}": d for d in PREFECT_YAML["deployments"]}


@pytest.mark.parametrize("name", ["smoke", "nightly", "full", "train", "cluster"])
def test_every_profile_validates(name: str) -> None:
    cfg = load_config(profile_path(name))
    assert cfg.profile == name


@pytest.mark.parametrize("name", ["smoke", "nightly", "full", "train"])
def test_local_profiles_run_in_the_stack_run_directory_and_track(name: str) -> None:
    # The stack's broker PID file, manifests and MLflow store live in its run directory (.kbit).
    cfg = load_config(profile_path(name))
    assert cfg.workdir == Path(".kbit") and cfg.tracking.enabled and cfg.kafka.uses_embedded


def test_profiles_grow_from_smoke_to_full() -> None:
    smoke, nightly, full = (load_config(profile_path(n)) for n in ("smoke", "nightly", "full"))
    assert smoke.dataset.num_records < nightly.dataset.num_records == full.dataset.num_records
    assert smoke.bench.iterations < nightly.bench.iterations
    assert len(smoke.bench.variants) < len(nightly.bench.variants) < len(full.bench.variants)


def test_full_profile_covers_every_supported_format_layout_and_compression() -> None:
    full = load_config(profile_path("full"))
    expected = {
        (f, layout, c) for f in FORMATS for layout in ("list", "bytes") for c in COMPRESSIONS if supported(f, layout)
    }
    assert {(v.format, v.layout, v.compression) for v in full.bench.variants} == expected
    assert set(full.bench.clients) == {"confluent", "kafka-python"}


def test_cluster_profile_leaves_the_machine() -> None:
    cfg = load_config(profile_path("cluster"))
    assert not cfg.kafka.uses_embedded and cfg.kafka.security_protocol == "SASL_SSL"
    assert cfg.kafka.sasl_password is None  # secrets come from the worker's environment, never the file
    assert cfg.launch.master.startswith("spark://") and not cfg.launch.local_mode and cfg.launch.use_gpu
    assert cfg.tracking.tracking_uri.startswith("http://") and cfg.stack.prefect_api_url.startswith("http://")


@pytest.mark.parametrize("name", ["train-cluster", "bench-cluster"])
def test_test_bed_profiles_put_ranks_on_the_nodes_and_read_over_tls(name: str) -> None:
    cfg = load_config(profile_path(name))
    assert cfg.launch.master == "spark://10.213.7.1:7077" and not cfg.launch.local_mode
    assert cfg.launch.driver_host == cfg.launch.driver_bind_address == "10.213.7.1"  # reachable from the nodes
    assert cfg.kafka.bootstrap_servers == "10.213.7.1:19093,10.213.7.11:19093,10.213.7.12:19093"
    assert cfg.kafka.security_protocol == "SASL_SSL" and cfg.kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert cfg.kafka.topic_replication_factor == 3
    assert cfg.kafka.ssl_certfile is not None and cfg.kafka.ssl_keyfile is not None  # the bed asks for mutual TLS


def test_profile_is_found_by_name_by_file_name_and_by_path(tmp_path: Path) -> None:
    own = tmp_path / "mine.yaml"
    own.write_text("profile: mine\n")
    assert profile_path("smoke") == profile_path("smoke.yaml") == PROJECT_ROOT / "deployments/profiles/smoke.yaml"
    assert profile_path(str(own)) == own
    with pytest.raises(ConfigError, match=r"'nope'.*known profiles: \[.*'nightly'.*'smoke'"):
        profile_path("nope")


def test_worker_environment_fills_tracking_uri_and_sasl_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.setenv("KBIT_KAFKA_SASL_PASSWORD", "s3cret")
    smoke = load_run_config.fn("smoke")
    assert smoke.tracking.tracking_uri == "http://127.0.0.1:5999"
    assert smoke.kafka.sasl_password is None  # a PLAINTEXT profile takes no password from the environment
    cluster = load_run_config.fn("cluster")
    assert cluster.tracking.tracking_uri == "http://mlflow.example.internal:5000"  # the profile's choice wins
    assert cluster.kafka.sasl_password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cluster) and "s3cret" not in str(cluster.to_dict())


def test_prefect_yaml_deployments_are_descriptively_named() -> None:
    assert {
        "benchmark/nightly",
        "benchmark/smoke",
        "produce/smoke-topics",
        "sweep/train-hyperparameters",
        "train/ddp-cpu",
        "train/ddp-cluster",
    } <= set(DEPLOYMENTS)
    names = [name.split("/")[1] for name in DEPLOYMENTS]
    assert len(set(names)) == len(names)  # unique even without the flow name, as the Prefect UI lists them


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_entrypoint_accepts_its_parameters(name: str) -> None:
    dep = DEPLOYMENTS[name]
    path, func = dep["entrypoint"].split(":")
    flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), func)
    assert flow.name == name.split("/")[0]
    assert set(dep["parameters"]) <= set(inspect.signature(flow.fn).parameters)
    load_config(profile_path(dep["parameters"]["profile"]))
    assert dep["work_pool"]["name"] == "{{ $KBIT_WORK_POOL }}"
    assert dep["work_pool"]["job_variables"]["env"]["MLFLOW_TRACKING_URI"] == "{{ $KBIT_MLFLOW_TRACKING_URI }}"


def test_only_the_nightly_deployment_is_scheduled_and_it_compares() -> None:
    nightly = DEPLOYMENTS["benchmark/nightly"]
    assert nightly["schedules"] == [{"cron": "0 2 * * *", "timezone": "UTC", "active": True}]
    assert nightly["parameters"] == {"profile": "nightly", "compare_with_previous": True}
    assert all(not d["schedules"] for n, d in DEPLOYMENTS.items() if n != "benchmark/nightly")
    assert PREFECT_YAML["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PIPELINE_ROOT }}"}}
    ]
