"""Each topic's manifest kept in the broker as well, so every workdir that uses the broker finds it.

Topic names derive from the dataset and variant, so two workdirs (a deployment's ``.kbit`` and a command line's
``.kbit/bench-smoke``) ask for the same topic in the same broker. A manifest only under one workdir left the other
with "exists but has no manifest" and the advice ``--recreate``, which deletes the first one's data. So kbit also
writes every manifest it saves into the one-partition topic ``kbit.manifests`` (keyed by topic; the newest entry
wins), with the workdir that owns it: another workdir adopts it when it describes the same data, and is told whose
it is otherwise.
"""

from __future__ import annotations

import socket
import time

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from pydantic import BaseModel, ConfigDict, ValidationError

from kbit_core.config import KafkaConfig
from kbit_core.errors import TopicError
from kbit_core.kafka import admin, offsets
from kbit_core.kafka.clients import ConsumerUse, client_options, open_consumer
from kbit_core.kafka.manifest import Manifest

REGISTRY_TOPIC = "kbit.manifests"
READ_TIMEOUT_S = 10.0


class Registration(BaseModel):
    """The newest word on one topic: the manifest describing it (None once deleted) and the workdir owning it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    topic: str
    owner: str
    manifest: Manifest | None = None


def owner_name(workdir_resolved: str) -> str:
    """How a workdir names itself in the registry: host and absolute path."""
    return f"{socket.gethostname()}:{workdir_resolved}"


def register(kcfg: KafkaConfig, topic: str, owner: str, manifest: Manifest | None) -> None:
    """Record that ``owner`` holds ``manifest`` for ``topic`` (None: the topic was deleted)."""
    if not admin.topic_exists(kcfg, REGISTRY_TOPIC):
        try:
            admin.create_topic(kcfg, REGISTRY_TOPIC, 1)
        except TopicError:
            if not admin.topic_exists(kcfg, REGISTRY_TOPIC):  # else another kbit created it meanwhile
                raise
    entry = Registration(topic=topic, owner=owner, manifest=manifest)
    producer = Producer({**client_options(kcfg), "acks": "all", "enable.idempotence": True})
    failures: list[str] = []
    producer.produce(
        REGISTRY_TOPIC,
        key=topic.encode(),
        value=entry.model_dump_json().encode(),
        partition=0,
        on_delivery=lambda err, _msg: failures.append(err.str()) if err is not None else None,
    )
    left = producer.flush(kcfg.request_timeout_s)
    if left or failures:
        raise admin.unreachable(kcfg, f"recording {topic}'s manifest in {REGISTRY_TOPIC}: {failures or 'timed out'}")


def lookup(kcfg: KafkaConfig, topic: str) -> Registration | None:
    """The newest registration of ``topic``; None when no kbit recorded one in this broker."""
    if not admin.topic_exists(kcfg, REGISTRY_TOPIC):
        return None
    end = offsets.exact_end_offsets(kcfg, REGISTRY_TOPIC, [0])[0]
    newest: Registration | None = None
    for key, value in _read(kcfg, end):
        if key == topic.encode():
            try:
                newest = Registration.model_validate_json(value)
            except ValidationError:  # written by another kbit version: not ours to judge
                continue
    return newest


def _read(kcfg: KafkaConfig, end: int) -> list[tuple[bytes | None, bytes]]:
    """Every (key, value) of the registry up to offset ``end``."""
    consumer = open_consumer(kcfg, ConsumerUse(purpose="registry", reset_is_error=False))
    entries: list[tuple[bytes | None, bytes]] = []
    try:
        consumer.assign([TopicPartition(REGISTRY_TOPIC, 0, 0)])
        position, deadline = 0, time.monotonic() + READ_TIMEOUT_S
        while position < end:
            if time.monotonic() > deadline:
                raise admin.unreachable(kcfg, f"{REGISTRY_TOPIC} unread from offset {position} after {READ_TIMEOUT_S}s")
            for msg in consumer.consume(500, 0.2):
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(msg.error())
                    continue
                position = msg.offset() + 1
                if msg.value() is not None:
                    entries.append((msg.key(), msg.value()))
    except KafkaException as exc:
        raise admin.unreachable(kcfg, f"reading {REGISTRY_TOPIC}: {exc.args[0].str()}") from None
    finally:
        consumer.close()
    return entries
