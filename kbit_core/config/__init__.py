"""The one typed configuration model (pydantic) that drives the CLI, the Prefect flows and the deployments.

One module per concern (see each one's docstring); every name is importable from here."""

from kbit_core.config.base import COMPRESSIONS, FORMATS, ClientName, Compression, Format, Layout, Section
from kbit_core.config.credentials import is_secret_option, mask_credentials
from kbit_core.config.data import DatasetConfig, DataVariant, ProduceConfig, ReaderConfig, ShardConfig
from kbit_core.config.kafka import EmbeddedBrokerConfig, KafkaConfig
from kbit_core.config.kbit import KbitConfig, deep_merge, flatten, load_config, nest_dotted, parse_overrides
from kbit_core.config.launch import LaunchConfig, is_loopback, local_slots
from kbit_core.config.registry import LocalRegistryConfig, RegistryConfig
from kbit_core.config.runs import (
    LOOPBACK,
    BenchConfig,
    StackConfig,
    SweepConfig,
    TrackingConfig,
    default_bench_variants,
)
from kbit_core.config.topics import FeatureDtype, MappingConfig, SourceConfig
from kbit_core.config.training import (
    BUILTIN_OPTIMIZERS,
    BUILTIN_SCHEDULES,
    CheckpointConfig,
    DeepSpeedConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    StreamConfig,
    TensorParallelConfig,
    TrainConfig,
)

__all__ = [
    "COMPRESSIONS",
    "ClientName",
    "Compression",
    "FORMATS",
    "Format",
    "Layout",
    "Section",
    "is_secret_option",
    "mask_credentials",
    "EmbeddedBrokerConfig",
    "KafkaConfig",
    "LocalRegistryConfig",
    "RegistryConfig",
    "DataVariant",
    "DatasetConfig",
    "ProduceConfig",
    "ReaderConfig",
    "ShardConfig",
    "FeatureDtype",
    "MappingConfig",
    "SourceConfig",
    "BUILTIN_OPTIMIZERS",
    "BUILTIN_SCHEDULES",
    "CheckpointConfig",
    "DeepSpeedConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "StreamConfig",
    "TensorParallelConfig",
    "TrainConfig",
    "LaunchConfig",
    "is_loopback",
    "local_slots",
    "BenchConfig",
    "LOOPBACK",
    "StackConfig",
    "SweepConfig",
    "TrackingConfig",
    "default_bench_variants",
    "KbitConfig",
    "deep_merge",
    "flatten",
    "load_config",
    "nest_dotted",
    "parse_overrides",
]
