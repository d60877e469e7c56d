"""The local broker that ``kafka.embedded`` chooses (Tansu or Apache Kafka), and a block that runs it for one command."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.brokers.broker import EmbeddedBroker, port_open
from kbit_core.config import EmbeddedBrokerConfig, KafkaConfig, KbitConfig

log = logging.getLogger(__name__)


# The brokers embedded_broker started in this process, by address: when one dies, kbit says so (and how to go on)
# instead of advising `kbit stack up`, and no restart of the training is spent on it.
_started: dict[str, EmbeddedBroker | ApacheKafkaBroker] = {}


def died_here(kcfg: KafkaConfig) -> str | None:
    """What happened, in words, when the broker at ``kcfg``'s address is one this process started and it has died;
    None otherwise (not started here, or still running)."""
    broker = _started.get(kcfg.resolved_bootstrap())
    if broker is None or broker.status().running:
        return None
    return (
        f"the embedded {kcfg.embedded.broker} broker that this kbit command started on {broker.bootstrap} has died "
        f"(its output: {broker.log_path}); rerun the command, which starts it again"
    )


def local_broker(run_dir: Path, embedded: EmbeddedBrokerConfig) -> EmbeddedBroker | ApacheKafkaBroker:
    """The local broker ``kafka.embedded`` chooses (``broker``: tansu or apache-kafka), its files in ``run_dir``."""
    if embedded.broker == "apache-kafka":
        return ApacheKafkaBroker(run_dir, embedded.host, embedded.port, controller_port=embedded.controller_port)
    return EmbeddedBroker(run_dir, embedded.host, embedded.port)


@contextlib.contextmanager
def embedded_broker(cfg: KbitConfig) -> Iterator[None]:
    """Run the embedded broker for the duration of the block unless a broker already listens there.

    A broker started here is stopped afterwards (Tansu keeps topics in memory only, so they go with it; Apache
    Kafka keeps them on disk under the run dir).
    """
    host, port = cfg.kafka.embedded.host, cfg.kafka.embedded.port
    if not cfg.kafka.uses_embedded or port_open(host, port):
        yield
        return
    broker = local_broker(cfg.run_dir, cfg.kafka.embedded)
    log.info("starting the embedded %s broker on %s for this run", cfg.kafka.embedded.broker, broker.bootstrap)
    broker.start()
    _started[broker.bootstrap] = broker
    try:
        yield
    finally:
        del _started[broker.bootstrap]
        broker.stop()
