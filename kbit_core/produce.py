"""Produce a dataset into Kafka once per variant and record exactly where it went (a Manifest from delivery reports).

Message number m goes to partition ``m % partitions`` with key = its first sample index, so partitions are
balanced and the manifest can be checked message by message. A matching manifest whose offsets the broker still
holds is reused instead of producing again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO

from tqdm import tqdm

from kbit_core.checks import check_produce
from kbit_core.config import DataVariant, KbitConfig
from kbit_core.datasets import DatasetSource, open_source
from kbit_core.errors import ConfigError, KbitError, ManifestMismatchError, TopicError
from kbit_core.formats import Codec, ConfluentFramedCodec, variant_codec
from kbit_core.kafka import admin, manifest_registry, ownership
from kbit_core.kafka.contents import check_topic_and_records
from kbit_core.kafka.manifest import DataIdentity, DatasetInfo, Manifest, manifest_path, message_digest
from kbit_core.kafka.producers import DeliveryLedger, ProducerBackend, delivery_timeout_ms, make_producer

log = logging.getLogger(__name__)

# Records encoded per chunk: bounds memory (images + encoded values) whatever the dataset size.
CHUNK_RECORDS = 4096
# A record's framing inside its batch (batch header, lengths, key): what a message needs beyond its value.
RECORD_OVERHEAD_BYTES = 128
# How long every broker connection may be down before a produce gives up (see ProducerBackend.broker_lost_s).
BROKER_LOST_S = 5.0


def kbit_version() -> str:
    try:
        return version("kbit")
    except PackageNotFoundError:
        return "unknown"


def _send_dataset(
    cfg: KbitConfig,
    variant: DataVariant,
    topic: str,
    source: DatasetSource,
    codec: Codec,
    backend: ProducerBackend,
    progress: bool,
) -> DeliveryLedger:
    """Encode the source chunk by chunk and send every message; returns the filled ledger."""
    partitions = cfg.produce.partitions
    per_message = variant.records_per_message
    # chunks hold whole messages, so message numbering and grouping continue across chunks
    chunk = per_message * max(1, CHUNK_RECORDS // per_message)
    ledger = DeliveryLedger(topic, partitions, cfg.kafka)
    message_no = 0
    with tqdm(
        total=source.num_records,
        unit="rec",
        unit_scale=True,
        desc=f"produce {variant.name}",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for indices, images, labels in source.batches(0, source.num_records, chunk):
            for j, value in enumerate(codec.encode(indices, images, labels)):
                first = j * per_message
                records = min(per_message, len(indices) - first)
                key = str(int(indices[first])).encode("ascii")
                backend.send(
                    topic,
                    message_no % partitions,
                    key,
                    value,
                    ledger.callback(records, len(value), message_digest(key, value)),
                )
                message_no += 1
            ledger.raise_errors()
            bar.update(len(indices))
        backend.flush(delivery_timeout_ms(cfg.kafka) / 1000)
    return ledger


def _requested_identity(cfg: KbitConfig, variant: DataVariant) -> tuple[DataIdentity, DatasetSource, Codec]:
    source = open_source(cfg.dataset)
    codec = variant_codec(variant, source)
    info = DatasetInfo(
        name=source.name,
        seed=cfg.dataset.seed,
        num_records=source.num_records,
        image_shape=tuple(source.image_shape),
        num_classes=source.num_classes,
        record_dtype=source.record_dtype,
        vocab_size=source.vocab_size,
    )
    identity = DataIdentity(
        dataset=info, variant=variant, partitions=cfg.produce.partitions, schema_fingerprint=codec.schema_fingerprint()
    )
    return identity, source, codec


def _reusable(cfg: KbitConfig, topic: str, identity: DataIdentity) -> Manifest | None:
    """The saved manifest when the topic still holds exactly it; None when the topic must be (re)produced.

    The manifest is this workdir's, or else the one another workdir recorded in the broker's registry, which is
    then adopted (saved here too). Raises ManifestMismatchError when what exists differs from the request (the
    caller handles recreate).
    """
    path = manifest_path(cfg.workdir, topic)
    exists = admin.topic_exists(cfg.kafka, topic)
    if not exists:
        if path.is_file():
            # A stale manifest describes data that no longer exists, so it cannot conflict with the request.
            log.warning(
                "topic %s is gone from the %s (a memory-only broker loses topics on restart); producing it again",
                topic,
                admin.describe_broker(cfg.kafka),
            )
        return None
    marker = _partial_marker(cfg, topic)
    if marker.is_file() and not path.is_file():
        log.warning(
            "topic %s was left partly written by an earlier produce from this workdir (%s); deleting it and "
            "producing it afresh",
            topic,
            marker.read_text(),
        )
        admin.delete_topic(cfg.kafka, topic)
        marker.unlink()
        return None
    saved, source = _known_manifest(cfg, topic)
    adopted = source != str(path)
    diffs = saved.identity.differences(identity)
    if diffs:
        keep_apart = "; set produce.topic to keep this dataset apart (--recreate deletes it)" if adopted else ""
        raise ManifestMismatchError(
            f"the manifest of topic {topic!r} ({source}) differs from the request{keep_apart} "
            "(manifest != request):\n  " + "\n  ".join(diffs)
        )
    admin.refuse_compacted(cfg.kafka, topic)
    check = check_topic_and_records(cfg.kafka, saved, verified_at=cfg.manifest_dir / f".{topic}.verified")
    if check.problems:
        raise ManifestMismatchError(
            f"topic {topic!r} no longer holds its manifest {source}: {'; '.join(check.problems)}; "
            "produce it again with --recreate (produce.recreate)"
        )
    if adopted:
        log.info("adopting the manifest of topic %s (%s) into %s", topic, source, path)
        saved.save(cfg.manifest_dir)
    return saved


def _known_manifest(cfg: KbitConfig, topic: str) -> tuple[Manifest, str]:
    """The manifest of an existing ``topic`` and where it came from: the broker registry's newest entry when
    another workdir recorded one since (it produced the topic again), else this workdir's."""
    path = manifest_path(cfg.workdir, topic)
    local = Manifest.load(path) if path.is_file() else None
    registered = _registration(cfg, topic)
    if registered is not None and registered.manifest is not None and registered.manifest != local:
        if not registered.manifest.kbit_wrote_it:
            raise ownership.not_kbits(topic, "write")
        return registered.manifest, f"recorded in {manifest_registry.REGISTRY_TOPIC} by {registered.owner}"
    if local is None or not local.kbit_wrote_it:
        raise ownership.not_kbits(topic, "write")
    return local, str(path)


def _registration(cfg: KbitConfig, topic: str) -> manifest_registry.Registration | None:
    """The broker registry's entry for ``topic``; None (with a warning) when the broker cannot tell."""
    try:
        return manifest_registry.lookup(cfg.kafka, topic)
    except KbitError as exc:
        log.warning("cannot look topic %s up in %s: %s", topic, manifest_registry.REGISTRY_TOPIC, exc)
        return None


def record_manifest(cfg: KbitConfig, topic: str, manifest: Manifest | None) -> None:
    """Record ``manifest`` (None: deleted) in the broker registry; a broker that refuses it only costs the sharing."""
    try:
        manifest_registry.register(cfg.kafka, topic, manifest_registry.owner_name(str(cfg.run_dir)), manifest)
    except KbitError as exc:
        log.warning(
            "cannot record the manifest of %s in %s (other workdirs will not find it): %s",
            topic,
            manifest_registry.REGISTRY_TOPIC,
            exc,
        )


def _delete_for_recreate(cfg: KbitConfig, topic: str) -> None:
    """Delete ``topic`` and this workdir's manifest of it, saying so when another workdir's manifest owns it."""
    registered = _registration(cfg, topic) if admin.topic_exists(cfg.kafka, topic) else None
    me = manifest_registry.owner_name(str(cfg.run_dir))
    if registered is not None and registered.manifest is not None and registered.owner != me:
        log.warning(
            "--recreate deletes topic %s, which %s produced and describes in its manifest (%s); "
            "it is produced again here, and that workdir will find the new manifest",
            topic,
            registered.owner,
            manifest_registry.REGISTRY_TOPIC,
        )
    manifest_path(cfg.workdir, topic).unlink(missing_ok=True)
    if admin.delete_topic(cfg.kafka, topic) and registered is not None:
        record_manifest(cfg, topic, None)


def produce_dataset(
    cfg: KbitConfig,
    variant: DataVariant | None = None,
    *,
    recreate: bool | None = None,
    progress: bool = True,
    client: str | None = None,
    checked: bool = False,
) -> Manifest:
    """Make sure the variant's topic holds the dataset, producing it if needed, and return its manifest.

    A matching manifest whose offsets the broker still holds is reused as is; a topic that vanished
    (embedded broker restarted) is produced again. Anything else that differs raises
    ManifestMismatchError unless ``recreate`` (default ``cfg.produce.recreate``), which deletes and
    produces afresh. ``checked``: the caller's preflight already ran :func:`check_produce` for this topic.
    """
    topic = cfg.produce.topic_for(cfg.dataset, variant)
    variant = variant or cfg.produce.variant
    recreate = cfg.produce.recreate if recreate is None else recreate
    identity, source, codec = _requested_identity(cfg, variant)
    if not checked:
        check_produce(cfg, topic, variant, source.num_records)
    with _producing(cfg, topic):
        path = manifest_path(cfg.workdir, topic)
        if recreate:
            ownership.refuse_unless_kbits(cfg.kafka, cfg.workdir, topic, "delete", [_partial_marker(cfg, topic)])
            _delete_for_recreate(cfg, topic)
        else:
            reused = _reusable(cfg, topic, identity)
            if reused is not None:
                log.info("reusing topic %s (%d records, manifest %s)", topic, reused.num_records, path)
                return reused
            path.unlink(missing_ok=True)
        return _produce(cfg, topic, variant, identity, source, codec, client, progress)


@contextlib.contextmanager
def _producing(cfg: KbitConfig, topic: str) -> Iterator[None]:
    """Hold ``<workdir>/manifests/.<topic>.lock`` from deciding to produce until the manifest is saved.

    A second produce of the topic meanwhile would find it without a manifest and ask for ``--recreate``, which
    would delete the data the first one is writing; it is told the truth instead. The OS releases the lock
    when its holder exits, however it exits, so a crashed produce never blocks the next one.
    """
    cfg.manifest_dir.mkdir(parents=True, exist_ok=True)
    with (cfg.manifest_dir / f".{topic}.lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TopicError(
                f"another produce of topic {topic!r} is in progress ({_lock_note(lock)}); "
                "run again once it has finished, and the topic it wrote will be reused"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_note(lock: IO[str], wait_s: float = 2.0) -> str:
    """The lock holder's note. The holder writes it just after taking the lock, so a produce that lost the race by
    microseconds may find the file still empty: it waits briefly for the note rather than name nobody."""
    deadline = time.monotonic() + wait_s
    while True:
        lock.seek(0)
        note = lock.read().strip()
        if note or time.monotonic() > deadline:
            return note or "its holder has not identified itself yet"
        time.sleep(0.01)


def _produce(
    cfg: KbitConfig,
    topic: str,
    variant: DataVariant,
    identity: DataIdentity,
    source: DatasetSource,
    codec: Codec,
    client: str | None,
    progress: bool,
) -> Manifest:
    """Create ``topic``, send the dataset into it and save the manifest its delivery reports give.

    A produce that does not finish (an error, an interrupt, a lost broker) deletes the topic it began, or, when
    the broker cannot be reached, leaves a note so that the next produce from this workdir does.
    """
    if isinstance(codec, ConfluentFramedCodec):
        codec.bind(cfg.registry, topic)  # registers kbit's schema under the topic's subject
    backend = make_producer(cfg.kafka, cfg.produce, variant.compression, client, broker_lost_s=BROKER_LOST_S)
    marker = _partial_marker(cfg, topic)
    try:
        _check_message_size(cfg, topic, variant, source, codec, backend)
        marker.write_text(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}")
        admin.create_topic(cfg.kafka, topic, cfg.produce.partitions)
        started = time.perf_counter()
        ledger = _send_dataset(cfg, variant, topic, source, codec, backend, progress)
        wire_bytes = backend.wire_bytes()
        seconds = time.perf_counter() - started
        manifest = _manifest_of(topic, identity, ledger, wire_bytes, seconds, backend.name)
        if manifest.dropped_records:
            raise TopicError(f"{topic}: {manifest.dropped_records} of {source.num_records} records were not delivered")
    except BaseException:
        backend.close()
        if marker.is_file():
            _discard_partial(cfg, topic, marker)
        raise
    backend.close()
    saved = manifest.save(cfg.manifest_dir)
    marker.unlink()
    record_manifest(cfg, topic, manifest)
    log.info(
        "produced %s: %d records in %d messages, %.1f MB in %.2fs; manifest %s",
        topic,
        manifest.num_records,
        manifest.num_messages,
        manifest.value_bytes / 1e6,
        seconds,
        saved,
    )
    return manifest


def _manifest_of(
    topic: str, identity: DataIdentity, ledger: DeliveryLedger, wire_bytes: int | None, seconds: float, client: str
) -> Manifest:
    partitions = ledger.partitions()
    return Manifest(
        topic=topic,
        dataset=identity.dataset,
        variant=identity.variant,
        schema_fingerprint=identity.schema_fingerprint,
        partitions=partitions,
        num_messages=sum(p.num_messages for p in partitions),
        num_records=sum(p.num_records for p in partitions),
        value_bytes=sum(p.value_bytes for p in partitions),
        wire_bytes=wire_bytes,
        dropped_records=identity.dataset.num_records - ledger.delivered_records,
        produce_seconds=seconds,
        client=client,
        kbit_version=kbit_version(),
    )


def _partial_marker(cfg: KbitConfig, topic: str) -> Path:
    """Present while this workdir's produce of ``topic`` is under way or ended before its manifest was saved."""
    return cfg.manifest_dir / f".{topic}.partial"


def _discard_partial(cfg: KbitConfig, topic: str, marker: Path) -> None:
    """Delete the partly written ``topic``; when the broker cannot be reached, keep the marker for the next run."""
    try:
        admin.delete_topic(cfg.kafka, topic)
    except KbitError as exc:
        log.warning(
            "the partly written topic %s stays on the broker (%s); the next produce from this workdir deletes it "
            "and starts afresh",
            topic,
            exc,
        )
        return
    marker.unlink()
    log.warning("deleted the partly written topic %s; producing it again starts afresh", topic)


def _check_message_size(
    cfg: KbitConfig, topic: str, variant: DataVariant, source: DatasetSource, codec: Codec, backend: ProducerBackend
) -> None:
    """ConfigError before the topic is touched when one message (its first, encoded) exceeds what the producer
    client or the broker accepts: sending it would fail at the first delivery and leave an empty topic behind."""
    per_message = min(variant.records_per_message, source.num_records)
    indices, images, labels = next(source.batches(0, per_message, per_message))
    size = len(next(iter(codec.encode(indices, images, labels)))) + RECORD_OVERHEAD_BYTES
    limits = {f"{backend.name} producer's message size limit": backend.max_message_bytes()}
    broker_limit = admin.max_message_bytes(cfg.kafka, topic)
    if broker_limit is not None:
        limits[f"max.message.bytes of the {admin.describe_broker(cfg.kafka)}"] = broker_limit
    name, limit = min(limits.items(), key=lambda item: item[1])
    if size > limit:
        fitting = max(1, per_message * limit // size)
        raise ConfigError(
            f"produce.variant.records_per_message={variant.records_per_message}: one {variant.name} message is "
            f"{size:,} bytes (uncompressed), over the {name} ({limit:,} bytes); use at most about {fitting} "
            f"records per message"
        )


def ensure_topics(
    cfg: KbitConfig, variants: Iterable[DataVariant], *, progress: bool = True, checked: bool = False
) -> list[Manifest]:
    """produce_dataset for each variant (reusing whatever is already in place)."""
    return [produce_dataset(cfg, v, progress=progress, checked=checked) for v in variants]
