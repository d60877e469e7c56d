"""The whole configuration (KbitConfig) and how it is loaded from YAML files and dotted overrides."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from kbit_core.config.base import Section
from kbit_core.config.credentials import mask_credentials
from kbit_core.config.data import DatasetConfig, ProduceConfig, ReaderConfig, ShardConfig
from kbit_core.config.kafka import KafkaConfig
from kbit_core.config.launch import LaunchConfig
from kbit_core.config.registry import RegistryConfig
from kbit_core.config.runs import BenchConfig, StackConfig, SweepConfig, TrackingConfig
from kbit_core.config.topics import SourceConfig
from kbit_core.config.training import CheckpointConfig, DeepSpeedConfig, StreamConfig, TrainConfig
from kbit_core.errors import ConfigError

# Overrides every profile takes from the environment (see environment_overrides).
SETTINGS_VARIABLE = "KBIT_SET"

# Paths that ranks open themselves; relative ones mean "relative to the driver's working directory".
_RANK_PATHS = (
    ("kafka", "ssl_cafile"),
    ("kafka", "sasl_password_file"),
    ("kafka", "ssl_certfile"),
    ("kafka", "ssl_keyfile"),
    ("registry", "ssl_cafile"),
    ("registry", "ssl_certfile"),
    ("registry", "ssl_keyfile"),
    ("dataset", "path"),
    ("launch", "gpu_discovery_script"),
)


class KbitConfig(Section):
    profile: str = "default"
    workdir: Path = Field(Path(".kbit"), description="Run directory: broker pid/log, manifests, reports, mlflow.db.")
    dataset: DatasetConfig = DatasetConfig()
    kafka: KafkaConfig = KafkaConfig()
    registry: RegistryConfig = RegistryConfig()
    produce: ProduceConfig = ProduceConfig()
    source: SourceConfig = SourceConfig()
    shard: ShardConfig = ShardConfig()
    reader: ReaderConfig = ReaderConfig()
    train: TrainConfig = TrainConfig()
    stream: StreamConfig = StreamConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()
    bench: BenchConfig = BenchConfig()
    tracking: TrackingConfig = TrackingConfig()
    sweep: SweepConfig = SweepConfig()
    stack: StackConfig = StackConfig()

    @property
    def run_dir(self) -> Path:
        return self.workdir.resolve()

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: the processes over pipeline stages × tensor-parallel size (readers of distinct data)."""
        return self.launch.num_processes // (self.train.pipeline.stages * self.train.tensor_parallel.size)

    @property
    def manifest_dir(self) -> Path:
        return self.run_dir / "manifests"

    def tracking_uri(self) -> str:
        return self.tracking.tracking_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"

    def experiment_name(self) -> str:
        return self.tracking.experiment or f"kbit-{self.profile}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict that round-trips through from_dict; secrets stay masked."""
        return self.model_dump(mode="json")

    def to_secret_dict(self) -> dict[str, Any]:
        """Like to_dict but with secrets revealed: only for handing to worker processes, never for logs."""
        return {**self.to_dict(), "kafka": self.kafka.secret_dict(), "registry": self.registry.secret_dict()}

    def to_secret_json(self) -> str:
        """The config as JSON with secrets revealed: the one form a rank receives (see ``from_json``).

        Paths a rank opens (the run directory, the dataset, TLS files, the GPU discovery script) are made
        absolute here, on the driver: an executor on another host starts in its own working directory.
        """
        data = self.to_secret_dict()
        data["workdir"] = str(self.run_dir)
        for section, key in _RANK_PATHS:
            if data[section][key] is not None:
                data[section][key] = str(Path(data[section][key]).expanduser().resolve())
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> KbitConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KbitConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_format_validation(exc)) from None

    def override(self, changes: dict[str, Any]) -> KbitConfig:
        """A validated copy with ``changes`` applied; keys are dotted paths or nested sections, secrets kept.

        ``cfg.override({"launch.num_processes": 4, "reader": {"mode": "eager"}})``
        """
        return KbitConfig.from_dict(deep_merge(self.to_secret_dict(), nest_dotted(changes)))

    def resuming(self, checkpoint: str | Path) -> KbitConfig:
        """This config, resuming from ``checkpoint``: a checkpoint file, a lineage directory, or ``latest``."""
        return self.override({"checkpoint.resume": str(checkpoint)})

    @model_validator(mode="after")
    def _cross_checks(self) -> KbitConfig:
        if self.deepspeed.enabled and self.train.precision == "fp16" and not self.launch.use_gpu:
            raise ValueError("fp16 DeepSpeed needs a GPU; use precision bf16 or fp32 on CPU")
        if self.train.precision == "fp16" and not self.launch.use_gpu:
            raise ValueError("train.precision=fp16 needs launch.use_gpu=true (CPU autocast supports bf16)")
        librdkafka_only = [
            f"{section}.client"
            for section, client in (("kafka", self.kafka.client), ("produce", self.produce.client))
            if client == "kafka-python"
        ]
        if self.kafka.extra and librdkafka_only:
            raise ValueError(
                f"kafka.extra holds librdkafka options, which the kafka-python client cannot take "
                f"({', '.join(librdkafka_only)} = kafka-python)"
            )
        self._check_pipeline_layout()
        self._check_tensor_parallel_layout()
        self._check_key_hash_split()
        if self.train.global_batch_size < self.launch.num_processes:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is smaller than "
                f"launch.num_processes={self.launch.num_processes}"
            )
        return self

    def _check_key_hash_split(self) -> None:
        if self.shard.split_by != "key_hash":
            return
        if self.source.topic is None:
            raise ValueError(
                "shard.split_by=key_hash splits a snapshot of a user's topic (source.topic) by its message keys; "
                "kbit's own topics split by ratio"
            )
        if self.train.mode == "continuous":
            raise ValueError(
                "shard.split_by=key_hash splits a snapshot; continuous training (train.mode=continuous) holds out "
                "the topic's first stream.eval_records records instead"
            )

    def _check_tensor_parallel_layout(self) -> None:
        size = self.train.tensor_parallel.size
        if size == 1:
            return
        if self.deepspeed.enabled:
            raise ValueError(f"train.tensor_parallel.size={size} runs on torch's DTensor: set deepspeed.enabled=false")
        if self.launch.num_processes % size:
            raise ValueError(
                f"launch.num_processes={self.launch.num_processes} is not a multiple of train.tensor_parallel.size={size}"
            )
        data_parallel = self.launch.num_processes // size
        if self.train.global_batch_size % data_parallel:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} does not split into {data_parallel} "
                "data-parallel ranks"
            )

    def _check_pipeline_layout(self) -> None:
        stages, micro = self.train.pipeline.stages, self.train.pipeline.micro_batches
        if stages == 1:
            return
        if not self.deepspeed.enabled or self.deepspeed.zero_stage > 1:
            raise ValueError(
                f"train.pipeline.stages={stages} runs on DeepSpeed: set deepspeed.enabled=true, zero_stage <= 1"
            )
        if self.launch.num_processes % stages:
            raise ValueError(
                f"launch.num_processes={self.launch.num_processes} is not a multiple of train.pipeline.stages={stages}"
            )
        data_parallel = self.launch.num_processes // stages
        if self.train.global_batch_size % (data_parallel * micro):
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} does not split into {data_parallel} "
                f"data-parallel ranks × train.pipeline.micro_batches={micro}"
            )


def _format_validation(exc: ValidationError) -> str:
    lines = [f"invalid kbit configuration ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML profile, resolving `extends: other.yaml` (relative to the file) recursively."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path} extends itself (cycle: {' -> '.join(map(str, seen + (path,)))})")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    parent = data.pop("extends", None)
    if parent:
        data = deep_merge(_read_yaml(path.parent / parent, seen + (path,)), data)
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys to string values; lists stay JSON so a param shows the whole list."""
    out: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def nest_dotted(dotted: dict[str, Any]) -> dict[str, Any]:
    """{'train.optim.lr': 0.1} -> {'train': {'optim': {'lr': 0.1}}}."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = (
            deep_merge(node[leaf], value) if isinstance(value, dict) and isinstance(node.get(leaf), dict) else value
        )
    return out


def environment_overrides() -> dict[str, Any]:
    """``$KBIT_SET``: ``section.key=value`` pairs, shell-quoted and space-separated, that every profile a shell loads
    takes (after the profile's own values, before ``--set``): a CI job's or a README run's ports and sizes."""
    try:
        return parse_overrides(shlex.split(os.environ.get(SETTINGS_VARIABLE, "")))
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{SETTINGS_VARIABLE}: {exc}") from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ['train.epochs=3', 'kafka.client=kafka-python'] into a nested dict; values parse as YAML."""
    dotted: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form section.key=value")
        key, raw = pair.split("=", 1)
        dotted[key] = _override_value(key, raw)
    return nest_dotted(dotted)


def _override_value(key: str, raw: str) -> Any:
    """One --set value parsed as YAML; a malformed one names its setting, in one line (YAML's own error spans six)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" at column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"--set {key}: the value {mask_credentials(raw)!r} is not valid YAML ({problem}{where})"
        ) from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | list[str] | None = None) -> KbitConfig:
    """Load a YAML profile (or the defaults), apply ``$KBIT_SET`` then the overrides, validate, and return the
    typed config."""
    data: dict[str, Any] = _read_yaml(Path(path)) if path else {}
    data = deep_merge(data, environment_overrides())
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    if overrides:
        data = deep_merge(data, overrides)
    return KbitConfig.from_dict(data)
