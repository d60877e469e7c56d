"""kbit's Kafka security settings against the test bed's brokers (mutual TLS and SCRAM-SHA-512, ACLs): every client
works, every mistake is named within seconds, and no credential reaches a file the project writes."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.config import KbitConfig, load_config
from kbit_core.data.reader import RangeReader
from kbit_core.errors import BrokerError, ConfigError, TopicError
from kbit_core.formats import get_codec
from kbit_core.kafka import admin
from kbit_core.kafka.consumers import make_consumer
from kbit_core.kafka.producers import make_producer
from kbit_core.produce import produce_dataset
from kbit_core.sharding import OffsetRange
from kbit_core.testbed import BedState
from kbit_core.testbed.certs import make_certificates
from kbit_core.testbed.kafka_bed import STRANGER_USER, password_path
from kbit_core.tracking import make_tracker

CLIENT_STEPS: dict[str, Callable[[KbitConfig, str], Any]] = {
    "admin": lambda cfg, client: admin.list_topics(cfg.kafka),
    "producer": lambda cfg, client: make_producer(cfg.kafka, cfg.produce, "none", client).close(),
    "consumer": lambda cfg, client: make_consumer(cfg.kafka, cfg.reader, client).close(),
}


def bed_config(testbed: BedState, workdir: Path, *sets: str, **sections: Any) -> KbitConfig:
    over = [f"{k}={v}" for k, v in testbed.kafka_overrides().items()]
    cfg = load_config(
        None,
        [
            f"workdir={workdir}",
            f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
            "dataset.num_records=64",
            "produce.partitions=2",
            *over,
            *sets,
        ],
    )
    return cfg.override(sections) if sections else cfg


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory: pytest.TempPathFactory, testbed: BedState):
    """A CA and client certificate the bed never saw (same addresses, so only the issuer differs)."""
    return make_certificates(tmp_path_factory.mktemp("foreign"), [testbed.driver.address], ["driver"])


def _mistakes(testbed: BedState, foreign, tmp: Path) -> dict[str, tuple[dict[str, Any], type[Exception], str]]:
    return {
        "wrong CA": ({"kafka.ssl_cafile": str(foreign.ca)}, BrokerError, "kafka.ssl_cafile"),
        "missing cert file": ({"kafka.ssl_certfile": str(tmp / "absent.pem")}, ConfigError, "kafka.ssl_certfile"),
        "key of another cert": ({"kafka.ssl_keyfile": str(foreign.client_key)}, ConfigError, "kafka.ssl_keyfile"),
        "no client cert": ({"kafka.ssl_certfile": None, "kafka.ssl_keyfile": None}, BrokerError, "kafka.ssl_certfile"),
        "client cert of another CA": (
            {"kafka.ssl_certfile": str(foreign.client_cert), "kafka.ssl_keyfile": str(foreign.client_key)},
            BrokerError,
            "kafka.ssl_certfile",
        ),
        "SASL mechanism the broker lacks": (
            {"kafka.sasl_mechanism": "SCRAM-SHA-256"},
            BrokerError,
            "kafka.sasl_mechanism",
        ),
        "wrong SCRAM password": ({"kafka.sasl_password": "not-it"}, BrokerError, "kafka.sasl_password"),
    }


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
@pytest.mark.parametrize("step", sorted(CLIENT_STEPS))
def test_every_client_works_over_mutual_tls(testbed: BedState, tmp_path: Path, client: str, step: str):
    cfg = bed_config(testbed, tmp_path, f"kafka.client={client}", f"produce.client={client}")
    CLIENT_STEPS[step](cfg, client)


@pytest.mark.parametrize(
    "mistake",
    [
        "wrong CA",
        "missing cert file",
        "key of another cert",
        "no client cert",
        "client cert of another CA",
        "SASL mechanism the broker lacks",
        "wrong SCRAM password",
    ],
)
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_security_mistake_is_named_within_seconds(
    testbed: BedState, foreign_certs, tmp_path: Path, client: str, mistake: str
):
    changes, error, setting = _mistakes(testbed, foreign_certs, tmp_path)[mistake]
    cfg = bed_config(
        testbed, tmp_path, f"kafka.client={client}", f"produce.client={client}", "kafka.request_timeout_s=30"
    ).override(changes)
    for step in ("consumer", "producer"):
        started = time.monotonic()
        with pytest.raises(error, match=setting.replace(".", r"\.")) as caught:
            CLIENT_STEPS[step](cfg, client)
        # well inside the 30 s request timeout: the mistake is found, not waited out
        assert time.monotonic() - started < cfg.kafka.request_timeout_s / 2, caught.value
        assert "not-it" not in str(caught.value)


def _every_file_under(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*") if p.is_file()]


def test_no_credential_reaches_any_file_the_project_writes(
    testbed: BedState, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The client key travels inline (kafka.extra ssl.key.pem) and a SASL password is configured: produce, read,
    track in MLflow, fail on SASL, print `stack env`; then no written file, log or output holds either secret."""
    key_pem = Path(testbed.ssl_keyfile).read_text()
    key_fragment = max(key_pem.splitlines(), key=len)  # a base64 line of the private key
    password = f"pw-{uuid.uuid4().hex}"
    log_file = tmp_path / "debug.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    caplog.set_level(logging.DEBUG)
    try:
        cfg = bed_config(
            testbed,
            tmp_path / "work",
            kafka={
                "ssl_certfile": None,
                "ssl_keyfile": None,
                "extra": {"ssl.key.pem": key_pem, "ssl.certificate.pem": Path(testbed.ssl_certfile).read_text()},
            },
        )
        manifest = produce_dataset(cfg, progress=False, recreate=True)
        v = manifest.variant
        codec = get_codec(v.format, v.layout, manifest.dataset.image_shape, v.records_per_message)
        ranges = [OffsetRange(p, a, b) for p, (a, b) in manifest.ranges().items()]
        with RangeReader(cfg.kafka, cfg.reader, manifest.topic, codec) as reader:
            assert sum(len(batch.labels) for _, batch in reader.read(ranges)) == 64
        sasl = cfg.override(
            {
                "kafka.security_protocol": "SASL_SSL",
                "kafka.sasl_mechanism": "SCRAM-SHA-256",
                "kafka.sasl_username": "kbit",
                "kafka.sasl_password": password,
            }
        )
        for run_cfg in (cfg, sasl):
            with make_tracker(run_cfg).run(run_cfg, name="secrets", kind="test"):
                pass
        with pytest.raises(BrokerError, match="kafka.sasl_mechanism"):
            produce_dataset(sasl, progress=False)
        sets = [
            f"workdir={tmp_path / 'work'}",
            "kafka.bootstrap_servers=k:9093",
            "kafka.security_protocol=SASL_SSL",
            "kafka.sasl_mechanism=SCRAM-SHA-256",
            "kafka.sasl_username=kbit",
            f"kafka.sasl_password={password}",
        ]
        env = CliRunner().invoke(app, ["stack", "env", *(arg for s in sets for arg in ("--set", s))])
        admin.delete_topic(cfg.kafka, manifest.topic)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert env.exit_code == 0, env.output
    texts = {"caplog": caplog.text, "stack env": env.output, "config dict": str(sasl.to_dict()), "repr": repr(sasl)}
    written = _every_file_under(tmp_path)
    assert any(p.name == "mlflow.db" for p in written) and log_file.stat().st_size > 0
    assert any(p.suffix == ".json" and "manifests" in p.parts for p in written)
    for secret in (key_fragment, password):
        assert [name for name, text in texts.items() if secret in text] == []
        assert [str(p) for p in written if secret.encode() in p.read_bytes()] == []


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_principal_without_an_acl_is_refused_naming_topic_and_principal(testbed: BedState, tmp_path: Path, client):
    """The training user's topic is replicated three times; the bed's other SCRAM user authenticates, but no ACL
    names it: reading the topic fails at once with one line naming the topic and the principal."""
    cfg = bed_config(testbed, tmp_path, f"kafka.client={client}", f"produce.client={client}")
    manifest = produce_dataset(cfg, progress=False, recreate=True)
    meta = admin._metadata(admin._admin(cfg.kafka), cfg.kafka, manifest.topic).topics[manifest.topic]
    assert [len(p.replicas) for p in meta.partitions.values()] == [3, 3]
    stranger = cfg.override(
        {
            "kafka.sasl_username": STRANGER_USER,
            "kafka.sasl_password_file": str(password_path(testbed.bed_dir, STRANGER_USER)),
        }
    )
    v = manifest.variant
    codec = get_codec(v.format, v.layout, manifest.dataset.image_shape, v.records_per_message)
    started = time.monotonic()
    with pytest.raises(TopicError) as caught:
        with RangeReader(stranger.kafka, stranger.reader, manifest.topic, codec, client) as reader:
            list(reader.read([OffsetRange(0, 0, 1)]))
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert f"User:{STRANGER_USER} is not authorized" in message and repr(manifest.topic) in message
    assert "\n" not in message
    admin.delete_topic(cfg.kafka, manifest.topic)
