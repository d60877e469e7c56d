"""Spark's own Kafka source (``spark.read.format("kafka")``) timed on kbit's topic, next to kbit's reader.

Spark reads exactly the manifest's offsets (``startingOffsets``/``endingOffsets`` per partition) and decodes in its
Python workers through the codec kbit's reader uses (the fast decoder), with ``mapInArrow``, into the same arrays
(index, label, pixels), which reach the driver as one Arrow table (``toArrow``). The records/s count every record
that reached the driver. It runs in a process of its own: Spark's jars are fixed when its JVM starts, and the
source's (``deployments/spark-kafka/pom.xml``, installed by ``scripts/run.sh install``) are added through
``launch.spark_conf``. Its session is kbit's (``launch`` settings, loopback). On a user's topic in the Confluent Avro
framing Spark decodes as its users do instead: ``from_avro`` (the spark-avro jar, installed beside the source) on
each value past its 5-byte header, with the subject's latest writer schema, selecting the mapped fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kbit_core.bench.dataplane.peer_harness import (
    FramedAvro,
    PeerReader,
    framed_avro,
    peer_codec,
    peer_row,
    timed_reads,
)
from kbit_core.config import KbitConfig
from kbit_core.errors import KbitError
from kbit_core.kafka.manifest import Manifest
from kbit_core.launch.spark import get_spark, stop_spark

READER = "spark_kafka_source"
SOURCE_JAR = "spark-sql-kafka-0-10_2.13-*.jar"
AVRO_JAR = "spark-avro_2.13-*.jar"  # from_avro, for a user's topic in the Confluent Avro framing
# The driver's side of the probe: the config (with any secret) and the manifest come through stdin.
SPARK_PROBE = """
import json, sys
from kbit_core.bench.dataplane.spark_kafka_peer import read_here
print(json.dumps(read_here(json.load(sys.stdin))))
"""


def source_jars(needed: tuple[str, ...] = (SOURCE_JAR,)) -> list[Path]:
    """The Spark Kafka source's jars: ``$KBIT_SPARK_KAFKA_LIBS`` or ``<venv>/kafka/spark-source/libs``, holding each
    of ``needed``."""
    libs = Path(os.environ.get("KBIT_SPARK_KAFKA_LIBS") or Path(sys.prefix) / "kafka" / "spark-source" / "libs")
    jars = sorted(libs.glob("*.jar"))
    missing = [glob for glob in needed if not any(j.match(glob) for j in jars)]
    if missing:
        raise KbitError(
            f"Spark's Kafka source is not installed ({libs} holds no {', '.join(missing)}): run `bash scripts/run.sh "
            "install` (needs Maven), or set KBIT_SPARK_KAFKA_LIBS to a directory holding it and its dependencies"
        )
    return jars


def measure_spark_source(cfg: KbitConfig, manifest: Manifest, repeats: int = 3) -> dict[str, Any]:
    """Spark's reader on the manifest's offsets in a fresh process: median records/s over ``repeats`` reads after
    one untimed warm-up, and the records it returned."""
    jars = ",".join(str(j) for j in source_jars((SOURCE_JAR, AVRO_JAR) if manifest.source else (SOURCE_JAR,)))
    spark_cfg = cfg.override({"launch.spark_conf": {**cfg.launch.spark_conf, "spark.jars": jars}})
    request = {"config": spark_cfg.to_secret_dict(), "manifest": manifest.model_dump_json(), "repeats": repeats}
    out = subprocess.run(
        [sys.executable, "-c", SPARK_PROBE], input=json.dumps(request), capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise KbitError(f"Spark's Kafka source failed on {manifest.topic}:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return peer_row(READER, manifest, result["records"], result["seconds"], spark_init_s=result["spark_init_s"])


def read_here(request: dict[str, Any]) -> dict[str, Any]:
    """In the probe process: start kbit's SparkSession and read the manifest's ranges ``repeats + 1`` times (the
    first starts Spark's Python workers and their imports)."""
    cfg = KbitConfig.from_dict(request["config"])
    manifest = Manifest.model_validate_json(request["manifest"])
    framed = framed_avro(cfg, manifest)
    started = time.perf_counter()
    spark = get_spark(cfg)
    init_s = time.perf_counter() - started
    try:
        records, seconds = timed_reads(
            lambda: _read(spark, cfg, manifest, request["manifest"], framed), request["repeats"]
        )
    finally:
        stop_spark()
    return {"records": records, "seconds": seconds, "spark_init_s": init_s}


def _read(spark: Any, cfg: KbitConfig, manifest: Manifest, manifest_json: str, framed: FramedAvro | None) -> int:
    ranges = manifest.ranges()
    topic = manifest.topic
    frame = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", cfg.kafka.resolved_bootstrap())
        .option("subscribe", topic)
        .option("startingOffsets", json.dumps({topic: {str(p): start for p, (start, _) in ranges.items()}}))
        .option("endingOffsets", json.dumps({topic: {str(p): stop for p, (_, stop) in ranges.items()}}))
        .load()
    )
    if framed is not None:
        return _from_avro(frame, framed).toArrow().num_rows
    decoded = frame.select("value").mapInArrow(
        lambda batches: _decode(batches, manifest_json), "index long, label long, pixels binary"
    )
    return decoded.toArrow().num_rows


def _from_avro(frame: Any, framed: FramedAvro) -> Any:
    """The mapped fields of Confluent-framed Avro values, decoded by Spark's own from_avro past the 5-byte header."""
    from pyspark.sql.avro.functions import from_avro  # pyspark: optional, and seconds to import
    from pyspark.sql.functions import col, expr

    record = from_avro(expr("substring(value, 6)"), framed.writer_schema).alias("record")
    return frame.select(record).select(*(col(f"record.{path}") for path in framed.fields))


def _decode(batches: Iterator[Any], manifest_json: str) -> Iterator[Any]:
    """Kafka values -> kbit's arrays (each record's pixels one binary value, without copying them per record)."""
    import pyarrow as pa  # pyspark's dependency, in Spark's Python workers

    codec = peer_codec(manifest_json)
    for batch in batches:
        got = codec.decode(batch.column(0).to_pylist())
        pixels = np.ascontiguousarray(got.pixels)
        row = pixels[0].nbytes if len(pixels) else 0
        offsets = np.arange(0, (len(pixels) + 1) * row, row, dtype=np.int32)
        column = pa.Array.from_buffers(pa.binary(), len(pixels), [None, pa.py_buffer(offsets), pa.py_buffer(pixels)])
        yield pa.RecordBatch.from_arrays(
            [pa.array(got.indices, pa.int64()), pa.array(got.labels, pa.int64()), column],
            ["index", "label", "pixels"],
        )


SPARK = PeerReader(
    "spark",
    "kbit's reader vs Spark's Kafka source (records/s, same topic, same run)",
    lambda cfg, manifest, repeats: [measure_spark_source(cfg, manifest, repeats)],
)
compare, peer_table = SPARK.compare, SPARK.table
