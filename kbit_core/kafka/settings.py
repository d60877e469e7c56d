"""Translate the typed Kafka config into each client library's connection options, and mask secrets for logs."""

from __future__ import annotations

from typing import Any

from kbit_core.config import KafkaConfig

_SECRET_HINTS = ("password", "secret", "token", "key.password", "sasl.oauthbearer")


def mask(options: dict[str, Any]) -> dict[str, Any]:
    """Copy of ``options`` with every credential-looking value replaced by '***'."""
    return {k: ("***" if any(h in k.lower() for h in _SECRET_HINTS) and v not in (None, "") else v)
            for k, v in options.items()}


def confluent_options(cfg: KafkaConfig) -> dict[str, Any]:
    """librdkafka connection options (bootstrap, security) shared by producer, consumer and admin."""
    opts: dict[str, Any] = {
        "bootstrap.servers": cfg.resolved_bootstrap(),
        "security.protocol": cfg.security_protocol.lower(),
        "socket.timeout.ms": int(cfg.request_timeout_s * 1000),
    }
    if cfg.sasl_mechanism:
        opts["sasl.mechanism"] = cfg.sasl_mechanism
        opts["sasl.username"] = cfg.sasl_username
        opts["sasl.password"] = cfg.sasl_password.get_secret_value() if cfg.sasl_password else ""
    if cfg.ssl_cafile:
        opts["ssl.ca.location"] = str(cfg.ssl_cafile)
    if cfg.ssl_certfile:
        opts["ssl.certificate.location"] = str(cfg.ssl_certfile)
    if cfg.ssl_keyfile:
        opts["ssl.key.location"] = str(cfg.ssl_keyfile)
    opts.update(cfg.extra)
    return opts


def kafka_python_options(cfg: KafkaConfig) -> dict[str, Any]:
    """kafka-python connection keyword arguments equivalent to :func:`confluent_options`."""
    opts: dict[str, Any] = {
        "bootstrap_servers": cfg.resolved_bootstrap().split(","),
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": int(cfg.request_timeout_s * 1000) + 1000,
    }
    if cfg.sasl_mechanism:
        opts["sasl_mechanism"] = cfg.sasl_mechanism
        opts["sasl_plain_username"] = cfg.sasl_username
        opts["sasl_plain_password"] = cfg.sasl_password.get_secret_value() if cfg.sasl_password else ""
    if cfg.ssl_cafile:
        opts["ssl_cafile"] = str(cfg.ssl_cafile)
    if cfg.ssl_certfile:
        opts["ssl_certfile"] = str(cfg.ssl_certfile)
    if cfg.ssl_keyfile:
        opts["ssl_keyfile"] = str(cfg.ssl_keyfile)
    return opts
