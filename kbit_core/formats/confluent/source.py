"""Writer schemas fetched by id from a Confluent-compatible Schema Registry through confluent-kafka's client,
cached, and retried within a deadline while the registry is down or slow; each failure in one line."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.common._httpx_compat import httpx  # httpx2 or httpx: whichever the client uses
from confluent_kafka.schema_registry.error import SchemaRegistryError as ClientError

from kbit_core.config.credentials import mask_credentials
from kbit_core.config.registry import RegistryConfig
from kbit_core.errors import SchemaRegistryError
from kbit_core.formats.confluent.framing import FramingError
from kbit_core.formats.confluent.framing import schema_id as framed_schema_id

log = logging.getLogger(__name__)

# The registry's answers for an id or subject it does not hold (Confluent's error codes, which Apicurio's ccompat
# API returns too): a record's problem, not the registry's.
NOT_FOUND_CODES = (40401, 40402, 40403)
RETRY_PAUSE_S = 0.5
# What a registry call raises when the registry, not the request, failed (unreachable, slow, 5xx).
REGISTRY_FAILURES = (httpx.HTTPError, ClientError)


class UnknownSchemaError(SchemaRegistryError):
    """The registry holds no schema with this id (or no such subject)."""


def at_record(
    exc: SchemaRegistryError, topic: str, records: Sequence[tuple[int, int, bytes | None]]
) -> SchemaRegistryError:
    """``exc`` naming where reading stopped: the first of ``records`` ((partition, offset, value) each) whose value
    asks for the schema id that failed (the first record when the failure named none)."""
    partition, offset, _ = next(
        (r for r in records if exc.schema_id is not None and _asks_for(r[2], exc.schema_id)), records[0]
    )
    return type(exc)(f"{exc} (topic={topic}, partition={partition}, offset={offset})", schema_id=exc.schema_id)


def _asks_for(value: bytes | None, wanted: int) -> bool:
    try:
        return framed_schema_id(value) == wanted
    except FramingError:
        return False


class SchemaSource:
    """One registry's schemas for this process: by id (immutable, kept forever) and a subject's latest."""

    def __init__(self, settings: RegistryConfig, client: SchemaRegistryClient | None = None) -> None:
        self.settings = settings
        self.url = mask_credentials(settings.resolved_url())
        self.client = client or SchemaRegistryClient(settings.client_conf())
        self._by_id: dict[int, Schema] = {}

    def schema(self, schema_id: int, topic: str | None = None) -> Schema:
        """The writer schema ``schema_id``; UnknownSchemaError when the registry has none with that id."""
        cached = self._by_id.get(schema_id)
        if cached is None:
            cached = self._by_id[schema_id] = self.call(
                f"schema id {schema_id}{f' (topic {topic})' if topic else ''}", self.client.get_schema, schema_id
            )
        return cached

    def latest(self, subject: str) -> tuple[int, Schema]:
        """The id and schema of ``subject``'s latest version."""
        registered = self.call(f"subject {subject!r}", self.client.get_latest_version, subject)
        self._by_id.setdefault(registered.schema_id, registered.schema)
        return registered.schema_id, registered.schema

    def call(self, what: str, method: Any, *args: Any) -> Any:
        """``method(*args)`` retried while the registry cannot be reached or answers 5xx, until ``deadline_s``."""
        deadline = time.monotonic() + self.settings.deadline_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(*args)
            except ClientError as exc:
                if exc.error_code in NOT_FOUND_CODES or exc.http_status_code == 404:
                    raise UnknownSchemaError(f"the Schema Registry at {self.url} holds no {what}") from None
                if exc.http_status_code in (401, 403):
                    raise SchemaRegistryError(
                        f"the Schema Registry at {self.url} refused kbit ({exc.http_status_code}) asking for {what}: "
                        "check registry.username/password or registry.bearer_token"
                    ) from None
                retriable, reason = exc.http_status_code >= 500, f"HTTP {exc.http_status_code}: {exc.error_message}"
            except httpx.HTTPError as exc:
                retriable, reason = True, f"{type(exc).__name__}: {exc}"
            if not retriable or time.monotonic() + RETRY_PAUSE_S > deadline:
                raise SchemaRegistryError(
                    f"the Schema Registry at {self.url} did not answer for {what} within registry.deadline_s="
                    f"{self.settings.deadline_s:g}s ({attempt} attempt(s), last: {mask_credentials(reason)})"
                ) from None
            log.info("Schema Registry %s: %s (attempt %d), retrying", self.url, reason, attempt)
            time.sleep(RETRY_PAUSE_S)
