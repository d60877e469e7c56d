"""What is produced and how it is split and read: the dataset, variant, produce, shard and reader sections."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kbit_core.config.base import ClientName, Compression, Format, Layout, Section


class DatasetConfig(Section):
    name: Literal["synthetic_digits", "synthetic_color", "synthetic_tokens", "mnist", "fashion_mnist"] = (
        "synthetic_digits"
    )
    num_records: int | None = Field(
        70_000, ge=1, description="Records to produce; for IDX datasets None means the whole file."
    )
    seed: int = 0
    path: Path | None = Field(None, description="Directory holding the IDX files (mnist / fashion_mnist).")
    split: Literal["train", "test", "all"] = Field("all", description="Which IDX files to read.")
    seq_len: int = Field(32, ge=1, description="synthetic_tokens: token ids per record.")
    vocab_size: int = Field(1000, ge=1, description="synthetic_tokens: ids lie in [0, vocab_size), sent as uint16.")

    @model_validator(mode="after")
    def _check_path(self) -> DatasetConfig:
        if self.name in ("mnist", "fashion_mnist") and self.path is None:
            raise ValueError(f"dataset {self.name!r} needs dataset.path (a directory with the IDX files)")
        return self

    @property
    def label(self) -> str:
        """The dataset's part of a topic name: its name, with a token source's sequence length and vocabulary."""
        return f"{self.name}.l{self.seq_len}.v{self.vocab_size}" if self.name == "synthetic_tokens" else self.name


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
        return f"{self.topic_prefix}.{dataset.label}.s{dataset.seed}.n{size}.{v.name}.p{self.partitions}"


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
