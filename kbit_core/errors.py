"""Exception types that name what failed and where, shared by every kbit_core module."""

from __future__ import annotations


class KbitError(Exception):
    """Base class: every error kbit raises on purpose derives from it.

    Its message is one plain line; ``details`` holds what only ``--debug`` prints (a worker's traceback)."""

    details: str | None = None


class ConfigError(KbitError):
    """The configuration is invalid or inconsistent."""


class BrokerError(KbitError):
    """The Kafka broker cannot be started, reached or used."""


class TopicError(KbitError):
    """A topic is missing, has the wrong partitions, or does not match its manifest."""


class ManifestMismatchError(TopicError):
    """A topic exists with a manifest that differs from the requested configuration."""


class RecordError(KbitError):
    """A Kafka record could not be read or decoded; carries its coordinates."""

    def __init__(
        self, message: str, *, topic: str | None = None, partition: int | None = None, offset: int | None = None
    ) -> None:
        where = ", ".join(
            f"{k}={v}" for k, v in (("topic", topic), ("partition", partition), ("offset", offset)) if v is not None
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.topic, self.partition, self.offset = topic, partition, offset


class SchemaRegistryError(KbitError):
    """The Schema Registry cannot be reached within its deadline, or refuses a request (authentication, a subject it
    does not know). ``schema_id``: the writer schema a value asked for, when one did."""

    def __init__(self, message: str, *, schema_id: int | None = None) -> None:
        super().__init__(message)
        self.schema_id = schema_id

    def __reduce__(self) -> tuple[object, ...]:  # decode worker processes send it back whole
        return _registry_error, (type(self), str(self), self.schema_id)


def _registry_error(kind: type[SchemaRegistryError], message: str, schema_id: int | None) -> SchemaRegistryError:
    return kind(message, schema_id=schema_id)


class CorruptRecordError(RecordError):
    """A record's bytes do not decode with the topic's codec."""


class OffsetRangeError(RecordError):
    """A planned offset range is not (or no longer) available on the broker."""


class ReadTimeoutError(RecordError):
    """The planned range was not fully read before the deadline."""


class DistributedError(KbitError):
    """The distributed environment is missing, inconsistent, or a worker failed."""


class TrainingDivergedError(KbitError):
    """The loss became NaN or infinite."""


class StatisticsError(KbitError):
    """Benchmark statistics were asked of empty or non-finite data."""


class TrackingError(KbitError):
    """The MLflow tracking server refuses kbit's login or cannot be reached."""
