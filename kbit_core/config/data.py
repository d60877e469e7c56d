"""What is produced and how it is split and read: the dataset, variant, produce, shard and reader sections."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from kbit_core.config.base import ClientName, Compression, Format, Layout, Section


class DatasetConfig(Section):
    name: Literal[
        "synthetic_digits", "synthetic_color", "synthetic_tokens", "mnist", "fashion_mnist", "torch", "arrays"
    ] = Field(
        "synthetic_digits",
        description="A generated dataset (digits, colour images or token sequences), IDX files (mnist / fashion_mnist), a map-style torch Dataset "
        "(torch: dataset.factory) or arrays in .npy/.npz files (arrays: dataset.path).",
    )
    num_records: int | None = Field(
        70_000,
        ge=1,
        description="Records to produce; for datasets read from files or a factory None means all (torch and "
        "arrays: None unless set).",
    )
    seed: int = 0
    path: Path | None = Field(
        None,
        description="mnist / fashion_mnist: the directory holding the IDX files; arrays: a .npz file, or a "
        "directory, holding images ([N, C, H, W] or [N, H, W]; uint8, or floats in [0, 1]) and labels ([N] integers).",
    )
    split: Literal["train", "test", "all"] = Field("all", description="Which IDX files to read.")
    seq_len: int = Field(32, ge=1, description="synthetic_tokens: token ids per record.")
    vocab_size: int = Field(1000, ge=1, description="synthetic_tokens: ids lie in [0, vocab_size), sent as uint16.")
    factory: str | None = Field(
        None,
        description="torch: 'package.module:factory', called with dataset.kwargs, returning a map-style "
        "torch.utils.data.Dataset whose items are (image [C, H, W] or [H, W] tensor, array or PIL image, label).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments for dataset.factory.")
    num_classes: int | None = Field(
        None,
        ge=1,
        description="torch / arrays: the number of classes; None: the dataset's `classes` or `num_classes` "
        "attribute (torch), the largest label + 1 (arrays).",
    )

    @model_validator(mode="before")
    @classmethod
    def _whole_map_style_dataset(cls, data: Any) -> Any:
        """A factory's or files' dataset is read whole unless dataset.num_records caps it (70,000 is the generated
        datasets' size, not a cap anyone would expect on their own)."""
        if isinstance(data, dict) and data.get("name") in ("torch", "arrays") and "num_records" not in data:
            return {**data, "num_records": None}
        return data

    @model_validator(mode="after")
    def _check_path(self) -> DatasetConfig:
        if self.name in ("mnist", "fashion_mnist", "arrays") and self.path is None:
            what = (
                "a .npz file or a directory of .npy files"
                if self.name == "arrays"
                else "a directory with the IDX files"
            )
            raise ValueError(f"dataset {self.name!r} needs dataset.path ({what})")
        if (self.name == "torch") != (self.factory is not None):
            raise ValueError("dataset.factory names the map-style Dataset of dataset.name 'torch', and only of it")
        return self

    @property
    def source_name(self) -> str:
        """The name manifests and topic names know the dataset by: a factory's or files' with a digest of which
        factory and arguments, or which path, and a token source's sequence length and vocabulary, so that two
        of them never share a topic."""
        if self.name == "torch":
            which = json.dumps([self.factory, self.kwargs], sort_keys=True, default=str)
        elif self.name == "arrays":
            which = str(Path(str(self.path)).expanduser().resolve())
        elif self.name == "synthetic_tokens":
            return f"{self.name}.l{self.seq_len}.v{self.vocab_size}"
        else:
            return self.name
        return f"{self.name}-{hashlib.sha256(which.encode()).hexdigest()[:8]}"


class DataVariant(Section):
    """One serialized form of the dataset: a format, a pixel layout and a compression codec."""

    format: Format = "avro"
    layout: Layout = "list"
    compression: Compression = "lz4"
    records_per_message: int = Field(1, ge=1)
    framing: Literal["kbit", "confluent"] = Field(
        "kbit",
        description="kbit: the format's own bytes; confluent: the Confluent wire format (magic byte, schema id, "
        "Protobuf's message indexes) written by confluent-kafka's serializers, kbit's schema registered under "
        "<topic>-value in the Schema Registry (registry.*); avro, json and protobuf only.",
    )

    @property
    def name(self) -> str:
        base = f"{self.format}_{self.layout}_{self.compression}"
        base = base if self.records_per_message == 1 else f"{base}_x{self.records_per_message}"
        return base if self.framing == "kbit" else f"{base}_confluent"

    @model_serializer(mode="wrap")
    def _kbit_framing_unwritten(self, handler: Any) -> dict[str, Any]:
        """kbit's own framing is left out of dumps, so manifests, run identities and baselines stay what they were
        before variants had a framing."""
        data = handler(self)
        if self.framing == "kbit":
            data.pop("framing", None)
        return data

    @model_validator(mode="after")
    def _framing_carries_format(self) -> DataVariant:
        if self.framing == "confluent" and self.format not in ("avro", "json", "protobuf"):
            raise ValueError(f"framing confluent carries avro, json and protobuf, not {self.format}")
        return self


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
        return f"{self.topic_prefix}.{dataset.source_name}.s{dataset.seed}.n{size}.{v.name}.p{self.partitions}"


class ShardConfig(Section):
    split_rates: list[float] = Field(default_factory=lambda: [6 / 7, 1 / 14, 1 / 14])
    split_by: Literal["ratio", "time", "key_hash"] = Field(
        "ratio",
        description="ratio: each split takes its rate's share of every partition; time (a snapshot of a user's "
        "topic, source.topic): train on the records before shard.split_times[0], val on those before "
        "split_times[1] (when given) and test on the later ones; splits past the last time share its records "
        "by their rates; key_hash (a snapshot of a user's topic): each message key goes to one split, drawn by "
        "its hash (seeded by shard.seed) with the split_rates as chances, so all records of a key land in one "
        "split; a record without a key is refused.",
    )
    split_times: list[datetime] = Field(
        default_factory=list,
        description="shard.split_by: time: where train ends, then (optionally) where val ends and test begins.",
    )
    remainder: Literal["drop", "pad"] = Field("drop", description="How ranks are given equal sample counts.")
    shuffle: bool = True
    seed: int = 0
    block_records: int = Field(
        4096,
        ge=1,
        description="Samples per shuffle block: read with one seek; larger reads faster, smaller shuffles finer.",
    )

    @model_validator(mode="after")
    def _time_split_has_a_time(self) -> ShardConfig:
        if (self.split_by == "time") != bool(self.split_times):
            raise ValueError("shard.split_times is set exactly when shard.split_by is 'time'")
        if len(self.split_times) > max(1, len(self.split_rates) - 1) or self.split_times != sorted(self.split_times):
            raise ValueError(
                f"shard.split_times needs 1 to {max(1, len(self.split_rates) - 1)} ascending times for "
                f"{len(self.split_rates)} split(s), got {len(self.split_times)}"
            )
        return self

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
    fetch: Literal["messages", "batches"] = Field(
        "messages",
        description="How ranges are fetched. messages: through kafka.client's consumer, one Python object per "
        "message; batches: kbit's own Fetch requests, whose record batches are parsed into columns over the "
        "fetched bytes (no object per record; the values of fixed-size records reach the decoder as one matrix). "
        "Bounds are still asked through confluent-kafka.",
    )
    prefetch_batches: int = Field(4, ge=1, description="Bounded queue of decoded batches per rank.")
    workers: Literal["thread", "process", "partitions"] = Field(
        "thread",
        description="Stream mode: where a rank's fetch, decode and batch assembly run. thread: threads of "
        "the rank (they share its GIL with the training loop); process: a child process per "
        "loader (kept across epochs, with a consumer of its own), handing finished batches "
        "over in shared memory; partitions: child processes that each fetch and decode the loader's blocks "
        "of some of its partitions (see reader.partition_workers) into shared memory, in parallel, while "
        "the rank cuts the batches.",
    )
    partition_workers: int = Field(
        0,
        ge=0,
        description="reader.workers: partitions: at most this many worker processes per loader, the "
        "topic's partitions dealt among them in turn (0: one per partition the loader reads).",
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
    keep_freed_memory: bool = Field(
        True,
        description="Keep the memory a reader frees for its next blocks (glibc's malloc thresholds, set once per "
        "process): otherwise each block's megabytes are mapped fresh and every page faults in on first touch "
        "(a third of a grouped topic's read CPU on this VM). false: freed memory goes back to the kernel at once.",
    )
    poll_timeout_s: float = Field(0.5, gt=0)
    deadline_s: float = Field(60.0, gt=0, description="Give up when a range makes no progress for this long.")
    max_poll_records: int = Field(4096, ge=1)
    fetch_max_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _decode_processes_need_threads(self) -> ReaderConfig:
        if self.decode_processes and self.workers != "thread":
            raise ValueError(
                "reader.decode_processes needs reader.workers: thread (a loader's worker process, "
                "a daemon, may not start processes of its own)"
            )
        return self
