"""Whether kbit created a topic, judged only from what kbit itself writes: its manifest in the workdir or in the
broker's manifest registry (``kbit.manifests``), or a note a caller names (a half-done produce, a live stream's
log). A topic without such evidence is a user's: kbit reads it (a snapshot) but never deletes, recreates or
writes it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kbit_core.config import KafkaConfig
from kbit_core.errors import KbitError, TopicError
from kbit_core.kafka import admin, manifest_registry
from kbit_core.kafka.manifest import Manifest, manifest_path


def kbit_evidence(kcfg: KafkaConfig, workdir: Path, topic: str, notes: Iterable[Path] = ()) -> str | None:
    """Where kbit recorded writing ``topic`` (a manifest of kbit's own data, or one of ``notes`` that exists); None
    when nothing says kbit wrote it. A snapshot's manifest is no evidence: it records a user's topic."""
    path = manifest_path(workdir, topic)
    if path.is_file() and Manifest.load(path).kbit_wrote_it:
        return str(path)
    for note in notes:
        if note.is_file():
            return str(note)
    try:
        registered = manifest_registry.lookup(kcfg, topic)
    except KbitError:
        return None  # the registry cannot be read: no evidence, so the topic is left alone
    if registered is not None and registered.manifest is not None and registered.manifest.kbit_wrote_it:
        return f"its manifest in {manifest_registry.REGISTRY_TOPIC}, recorded by {registered.owner}"
    return None


def not_kbits(topic: str, doing: str) -> TopicError:
    """The one-line refusal to ``doing`` (delete, recreate, write...) a topic kbit did not create."""
    return TopicError(
        f"topic {topic!r} exists and kbit did not create it (no kbit manifest for it in this workdir or "
        f"{manifest_registry.REGISTRY_TOPIC}), so kbit will not {doing} it; produce into another topic (produce.topic), or "
        f"train on it as it is: source.topic={topic} with a source.mapping (docs/your_topics.md)"
    )


def refuse_unless_kbits(kcfg: KafkaConfig, workdir: Path, topic: str, doing: str, notes: Iterable[Path] = ()) -> None:
    """TopicError (:func:`not_kbits`) when ``topic`` exists and nothing says kbit created it."""
    if admin.topic_exists(kcfg, topic) and kbit_evidence(kcfg, workdir, topic, notes) is None:
        raise not_kbits(topic, doing)
