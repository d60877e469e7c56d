"""The trained model in MLflow's Model Registry: an ``mlflow.pytorch`` model (a pyfunc, so ``mlflow models serve``
serves it) with a signature and an input example, registered under one name per dataset and model, each version
tagged with the run that trained it and the data it saw."""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.kafka.manifest import Manifest
from kbit_core.tracking.artifacts import storing
from kbit_core.tracking.training import dataset_label, headline, name_part
from kbit_core.train import checkpoint as ckpt

MODEL_ARTIFACT = "model"


def registered_model_name(cfg: KbitConfig) -> str:
    """The registry name every run of this dataset and model adds a version to, e.g. ``kbit-fashion_mnist-cnn``."""
    return f"kbit-{dataset_label(cfg)}-{name_part(cfg.train.model.name)}"


def data_tags(result: Mapping[str, Any]) -> dict[str, str]:
    """What data the model saw: the topic, each partition's offsets (``partition:first:last``) and the SHA-256 of
    the manifest file that lists them (``sha256sum <workdir>/manifests/<topic>.json``); or, for ``train.data:
    direct``, the dataset; a stream run's held-out topic besides."""
    tags = {k: str(result[k]) for k in ("topic", "heldout_topic", "dataset") if result.get(k)}
    path = Path(result["manifest_path"]) if result.get("manifest_path") else None
    if path is not None and path.is_file():
        tags["offsets"] = ",".join(Manifest.load(path).offset_strings())
        tags["manifest_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return tags


def register_model(
    cfg: KbitConfig, client: Any, run_id: str, model_path: Path, result: Mapping[str, Any]
) -> tuple[str, str]:
    """Log the model in ``model_path`` to the run and register it; its (name, version)."""
    import mlflow  # mlflow and torch load only when a model is logged: both take seconds to import
    import mlflow.pytorch
    import torch

    model, image_shape = ckpt.load_model(cfg, model_path)
    requirements = [f"{d}=={importlib.metadata.version(d).split('+')[0]}" for d in ("torch", "numpy")]
    # MLflow 3 saves a traced torch.export program (no pickle), which needs an example input to trace (and infers the
    # signature from it); a batch of 2, because torch.export specialises a batch dimension of 1 into a fixed size.
    example = torch.zeros((2, *image_shape), dtype=torch.float32 if len(image_shape) == 3 else torch.int64).numpy()
    name = registered_model_name(cfg)
    with storing(cfg, run_id, MODEL_ARTIFACT), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model,
            name=MODEL_ARTIFACT,
            pip_requirements=requirements,
            input_example=example,
            registered_model_name=name,
        )
    version = str(info.registered_model_version)
    run = client.get_run(run_id)
    tags = {"run_id": run_id, "run_name": run.info.run_name, "checkpoint": str(model_path), **data_tags(result)}
    if isinstance(result.get("test_accuracy"), float):
        tags["test_accuracy"] = f"{result['test_accuracy']:.4f}"
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    client.update_model_version(name, version, description=headline(result))
    if not client.get_registered_model(name).description:
        client.update_registered_model(
            name,
            description=(
                f"`{cfg.train.model.name}` trained by kbit on `{dataset_label(cfg)}`: one version per training run, tagged "
                "with its run and the data it saw (topic, offsets, manifest_sha256). Inputs are float32 pixels in "
                "[0, 1] of shape [batch, C, H, W] (int64 token ids for token sequences); outputs are class logits."
            ),
        )
    return name, version
