"""kbit's own variants in the Confluent framing: produced through confluent-kafka's serializers (kbit's schema
registered in the real Schema Registry) into the real broker, and read back by kbit's reader into the same batches
as kbit's framing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from kbit_core.config import COMPRESSIONS
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats.fast import FastPath, select_codec
from kbit_core.kafka.manifest import manifest_codec
from kbit_core.service import Service
from kbit_core.sharding import OffsetRange
from tests.integration.dataplane_fixtures import Produce, inject

pytestmark = [pytest.mark.kafka]

NUM_RECORDS = 24
FORMATS = [
    ("avro", "list"),
    ("avro", "bytes"),
    ("protobuf", "list"),
    ("protobuf", "bytes"),
    ("json", "list"),
    ("json", "bytes"),
]


def read_all(cfg: Any, manifest: Any, decoder: str = "fast") -> dict[str, np.ndarray]:
    codec = manifest_codec(manifest, decoder)
    ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
    with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, "confluent") as reader:
        batches = [batch for _, batch in reader.read(ranges)]
    decoded = {k: np.concatenate([getattr(b, k) for b in batches]) for k in ("indices", "labels", "pixels")}
    order = np.argsort(decoded["indices"])
    return {k: v[order] for k, v in decoded.items()}


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize(("fmt", "layout"), FORMATS, ids=[f"{f}-{lay}" for f, lay in FORMATS])
def test_confluent_framing_reads_back_as_kbit_framing(
    produce_topic: Produce, schema_registry: Service, fmt: str, layout: str, compression: str
) -> None:
    variant = {"format": fmt, "layout": layout, "compression": compression}
    cfg, framed = produce_topic({**variant, "framing": "confluent"}, NUM_RECORDS, registry__url=schema_registry.url)
    _, plain = produce_topic(variant, NUM_RECORDS)
    assert framed.topic.endswith(f"{fmt}_{layout}_{compression}_confluent.p2")

    client = SchemaRegistryClient({"url": schema_registry.url})
    registered = client.get_latest_version(f"{framed.topic}-value")
    assert registered.schema.schema_type == {"avro": "AVRO", "json": "JSON", "protobuf": "PROTOBUF"}[fmt]
    for decoder in ("fast", "stock"):
        got, want = read_all(cfg, framed, decoder), read_all(cfg, plain, decoder)
        for key in ("indices", "labels", "pixels"):
            assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), (decoder, key)
    assert framed.value_bytes > plain.value_bytes  # the 5-byte header (and Protobuf's message index) on each


def test_grouped_values_and_a_record_not_in_the_framing(produce_topic: Produce, schema_registry: Service) -> None:
    variant = {"format": "protobuf", "layout": "bytes", "compression": "none", "records_per_message": 3}
    cfg, manifest = produce_topic(
        {**variant, "framing": "confluent"}, 10, partitions=1, registry__url=schema_registry.url
    )
    assert read_all(cfg, manifest)["indices"].tolist() == list(range(10))
    assert isinstance(select_codec(manifest_codec(manifest, "stock"), "fast").inner, FastPath)  # as the benches pick

    codec = manifest_codec(manifest, "fast")
    offset = inject(cfg, manifest.topic, 0, b"\x07not framed")
    with pytest.raises(CorruptRecordError) as exc:
        with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec, "confluent") as reader:
            list(reader.read([OffsetRange(0, offset - 1, offset + 1)]))
    message = str(exc.value)
    assert "\n" not in message and f"offset={offset}" in message and "magic byte" in message


def test_confluent_framing_needs_a_registry(produce_topic: Produce) -> None:
    with pytest.raises(ConfigError, match="registry.url"):
        produce_topic({"format": "avro", "layout": "bytes", "compression": "none", "framing": "confluent"}, 4)
    with pytest.raises(ValueError, match="framing confluent carries avro, json and protobuf"):
        produce_topic({"format": "raw", "layout": "bytes", "framing": "confluent"}, 4)
