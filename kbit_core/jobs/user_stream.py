"""Continuous training on a topic kbit did not write (``source.topic``): its partitions, and its held-out records,
the first ``stream.eval_records`` of the topic read as a snapshot, so nothing is created beside it."""

from __future__ import annotations

import logging
import math
import time

from kbit_core.config import KbitConfig
from kbit_core.errors import TopicError
from kbit_core.kafka import admin
from kbit_core.kafka.manifest import Manifest
from kbit_core.kafka.snapshot import topic_offsets
from kbit_core.topic_dataset import snapshot_dataset
from kbit_core.train.stream_worker import heldout_config

log = logging.getLogger(__name__)

WAIT_PAUSE_S = 0.5


def user_stream_config(cfg: KbitConfig) -> KbitConfig:
    """``cfg`` streaming ``source.topic`` once it exists (its producer may still be starting), with as many stream
    partitions as it has; TopicError after ``stream.idle_timeout_s``."""
    topic = cfg.source.topic
    assert topic is not None
    admin.wait_for_topic(cfg.kafka, topic, cfg.stream.idle_timeout_s, "source.topic", "start its producer first")
    partitions = len(admin.topic_partitions(cfg.kafka, topic))
    return cfg.override({"stream.topic": topic, "produce.partitions": partitions})


def heldout_ranges(cfg: KbitConfig) -> list[str]:
    """``source.ranges`` of the held-out records: the first ``stream.eval_records`` of the topic, an equal share
    of each partition from its first stored offset, waited for (within ``stream.idle_timeout_s`` of the last
    record that arrived) while the producer writes them."""
    topic = str(cfg.source.topic)
    deadline, seen = time.monotonic() + cfg.stream.idle_timeout_s, -1
    while True:
        bounds = topic_offsets(cfg.kafka, topic).bounds
        share = math.ceil(cfg.stream.eval_records / len(bounds))
        short = {p: high - low for p, (low, high) in bounds.items() if high - low < share}
        if not short:
            return [f"{p}:{low}:{low + share - 1}" for p, (low, _) in sorted(bounds.items())]
        stored = sum(high - low for low, high in bounds.values())
        if stored != seen:
            seen, deadline = stored, time.monotonic() + cfg.stream.idle_timeout_s
            log.info("topic %s: waiting for %d held-out records per partition (%s)", topic, share, short)
        elif time.monotonic() > deadline:
            raise TopicError(
                f"topic {topic!r} holds fewer than {share} records in partition(s) {sorted(short)} after "
                f"{cfg.stream.idle_timeout_s:.0f}s without a new record; its first stream.eval_records="
                f"{cfg.stream.eval_records} records (an equal share per partition) are held out for evaluation: "
                "lower stream.eval_records or write more"
            )
        time.sleep(WAIT_PAUSE_S)


def heldout_snapshot(cfg: KbitConfig) -> Manifest:
    """The held-out records' snapshot (taken, or the saved one while the topic still holds it), its mapping
    checked; validation and test are its halves (:func:`heldout_config`)."""
    asked = heldout_config(cfg).override({"source.ranges": heldout_ranges(cfg), "source.at": None})
    return snapshot_dataset(asked)
