"""Run on a test-bed node host: a user's producer, confluent-kafka alone, registers its own Avro schema at the bed's
Schema Registry and writes records with its AvroSerializer to a new topic on the bed's brokers (TLS and SCRAM), then
prints one JSON line: hostname, schema id, records written.

usage: python node_avro_producer.py STATE_JSON TOPIC COUNT
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

READING = {
    "type": "record",
    "name": "Reading",
    "namespace": "plant.sensors",
    "fields": [{"name": "levels", "type": {"type": "array", "items": "float"}}, {"name": "alarm", "type": "int"}],
}


def main(state_file: str, topic: str, count: str) -> None:
    state = json.loads(Path(state_file).read_text())
    conf = {
        "bootstrap.servers": state["broker_bootstrap"],
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": state["sasl_username"],
        "sasl.password": Path(state["sasl_password_file"]).read_text().strip(),
        "ssl.ca.location": state["ssl_cafile"],
        **({"ssl.certificate.location": state["ssl_certfile"]} if state["ssl_certfile"] else {}),
        **({"ssl.key.location": state["ssl_keyfile"]} if state["ssl_keyfile"] else {}),
    }
    admin = AdminClient(conf)  # held: a client collected while its future waits ends it
    admin.create_topics([NewTopic(topic, 2, 3)])[topic].result(60)
    serializer = AvroSerializer(SchemaRegistryClient({"url": state["registry_url"]}), json.dumps(READING))
    producer = Producer(conf)
    for n in range(int(count)):
        value = serializer(
            {"levels": [n / 10, 1.0, 2.0, 3.0], "alarm": n % 2}, SerializationContext(topic, MessageField.VALUE)
        )
        producer.produce(topic, value, f"sensor-{n}".encode(), partition=n % 2)
    assert producer.flush(60) == 0
    schema_id = SchemaRegistryClient({"url": state["registry_url"]}).get_latest_version(f"{topic}-value").schema_id
    print(json.dumps({"hostname": socket.gethostname(), "schema_id": schema_id, "written": int(count)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
