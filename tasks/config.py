"""Resolve a flow's `profile` + `overrides` into the validated KbitConfig (bad config fails here, never retried)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import task
from prefect.runtime import flow_run
from pydantic import SecretStr

from kbit_core.config import KbitConfig, load_config
from kbit_core.errors import ConfigError

DEPLOYMENTS_DIR = Path(__file__).resolve().parents[1] / "deployments"
SASL_PASSWORD_ENV = "KBIT_KAFKA_SASL_PASSWORD"
# The Schema Registry's credentials, from the worker's environment like the SASL password.
REGISTRY_SECRET_ENV = {"password": "KBIT_REGISTRY_PASSWORD", "bearer_token": "KBIT_REGISTRY_BEARER_TOKEN"}


def profile_path(profile: str) -> Path:
    """A YAML path as given, else a profile name looked up in deployments/profiles/ then deployments/."""
    given = Path(profile).expanduser()
    if given.is_file():
        return given
    name = given.name if given.suffix in (".yaml", ".yml") else f"{given.name}.yaml"
    for folder in (DEPLOYMENTS_DIR / "profiles", DEPLOYMENTS_DIR):
        if (folder / name).is_file():
            return folder / name
    known = sorted({p.stem for p in DEPLOYMENTS_DIR.glob("**/*.yaml")})
    raise ConfigError(f"profile {profile!r} is neither a YAML file nor a profile name; known profiles: {known}")


@task(name="load-config", retries=0)
def load_run_config(profile: str, overrides: dict[str, Any] | None = None) -> KbitConfig:
    """Load and validate the profile with overrides, completed from the flow-run environment.

    A deployment's job environment names the stack's MLflow server in MLFLOW_TRACKING_URI; it is
    used unless the profile or the overrides choose a tracking URI themselves. The Kafka SASL password
    comes from KBIT_KAFKA_SASL_PASSWORD (the worker's environment) so that it never appears among
    the flow-run parameters that Prefect stores and shows; the Schema Registry's password or bearer token from
    KBIT_REGISTRY_PASSWORD / KBIT_REGISTRY_BEARER_TOKEN, likewise. Every MLflow run the config starts is tagged with
    this flow run (:func:`flow_run_tags`).
    """
    cfg = load_config(profile_path(profile), overrides or {})
    env_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if env_uri and cfg.tracking.tracking_uri is None:
        cfg.tracking.tracking_uri = env_uri
    env_password = os.environ.get(SASL_PASSWORD_ENV)
    if env_password and cfg.kafka.sasl_mechanism and cfg.kafka.sasl_password is None:
        cfg.kafka.sasl_password = SecretStr(env_password)
    wants = {"password": cfg.registry.username is not None, "bearer_token": cfg.registry.url is not None}
    for name, variable in REGISTRY_SECRET_ENV.items():
        if os.environ.get(variable) and wants[name] and getattr(cfg.registry, name) is None:
            setattr(cfg.registry, name, SecretStr(os.environ[variable]))
    cfg.tracking.run_tags = {**flow_run_tags(), **cfg.tracking.run_tags}
    return cfg


def flow_run_tags() -> dict[str, str]:
    """The flow run as MLflow tags: its id, name and page in Prefect's UI (when the API has a UI to link to)."""
    if flow_run.id is None:
        return {}
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)}
    url = flow_run.ui_url
    if url and url.startswith(("http://", "https://")):
        tags["prefect.flow_run_url"] = url
    return tags
