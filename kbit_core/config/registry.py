"""Where the Schema Registry is and how kbit's clients reach it: kbit's local Apicurio Registry or a user's own
(URL, basic auth or a bearer token, TLS), its credentials kept secret like the Kafka password."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from kbit_core.config.base import Section

# The Confluent-compatible API of the local Apicurio Registry (what confluent-kafka's client speaks).
CCOMPAT_PATH = "/apis/ccompat/v7"


class LocalRegistryConfig(Section):
    enabled: bool = Field(
        False,
        description="Start kbit's own Schema Registry (Apicurio Registry, Java 21+) with `kbit stack up` and use "
        "it whenever registry.url is unset; its jars come from scripts/run.sh install.",
    )
    host: str = Field("127.0.0.1", description="Address the local registry binds to.")
    port: int = Field(18081, ge=1, le=65535, description="Its HTTP port (the Confluent-compatible API).")
    management_port: int | None = Field(
        None, ge=1, le=65535, description="Its health/metrics port (default: port + 1)."
    )
    storage: Literal["memory", "file"] = Field(
        "memory",
        description="memory: schemas live in an in-memory H2 database and are gone when the registry stops "
        "(ids restart at 1); file: an H2 file under <run dir>/registry, kept across restarts like the "
        "broker's data.",
    )
    java: Path | None = Field(
        None,
        description="The java (21+) that runs it; unset: $KBIT_REGISTRY_JAVA, $JAVA_HOME/bin/java, the newest "
        "JDK under /usr/lib/jvm, then java on PATH, whichever is 21 or newer.",
    )
    heap_mb: int = Field(256, ge=64, description="The registry JVM's maximum heap (-Xmx).")


class RegistryConfig(Section):
    url: str | None = Field(
        None,
        description="A Confluent-compatible Schema Registry (http(s)://host:port[/path]); unset: the local "
        "registry when registry.local.enabled, else none.",
    )
    local: LocalRegistryConfig = LocalRegistryConfig()
    username: str | None = Field(None, description="Basic auth user (with password).")
    password: SecretStr | None = Field(None, description="Basic auth password.")
    bearer_token: SecretStr | None = Field(None, description="A static bearer token (instead of basic auth).")
    bearer_logical_cluster: str = Field(
        "", description="Sent as target-sr-cluster with a bearer token (Confluent Cloud needs it; others ignore it)."
    )
    ssl_cafile: Path | None = Field(None, description="CA bundle that signed the registry's certificate.")
    ssl_certfile: Path | None = Field(None, description="Client certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(None, description="Client certificate's private key (mutual TLS).")
    request_timeout_s: float = Field(10.0, gt=0, description="One HTTP request's timeout.")
    deadline_s: float = Field(
        30.0, gt=0, description="How long a schema lookup is retried while the registry is down or slow."
    )

    @property
    def enabled(self) -> bool:
        """Whether any registry is configured (a user's own or the local one)."""
        return self.url is not None or self.local.enabled

    def resolved_url(self) -> str:
        """The registry's base URL as confluent-kafka's client takes it."""
        if self.url:
            return self.url.rstrip("/")
        return f"http://{self.local.host}:{self.local.port}{CCOMPAT_PATH}"

    def client_conf(self) -> dict[str, Any]:
        """confluent-kafka's SchemaRegistryClient configuration, secrets revealed: only for building a client.

        Retries are kbit's (within ``deadline_s``), so the client's own are off."""
        conf: dict[str, Any] = {"url": self.resolved_url(), "timeout": self.request_timeout_s, "max.retries": 0}
        if self.username is not None:
            secret = self.password.get_secret_value() if self.password is not None else ""
            conf["basic.auth.user.info"] = f"{self.username}:{secret}"
        if self.bearer_token is not None:
            conf["bearer.auth.credentials.source"] = "STATIC_TOKEN"
            conf["bearer.auth.token"] = self.bearer_token.get_secret_value()
            conf["bearer.auth.logical.cluster"] = self.bearer_logical_cluster
        for option, path in (
            ("ssl.ca.location", self.ssl_cafile),
            ("ssl.certificate.location", self.ssl_certfile),
            ("ssl.key.location", self.ssl_keyfile),
        ):
            if path is not None:
                conf[option] = str(Path(path).expanduser())
        return conf

    def secret_dict(self) -> dict[str, Any]:
        """This section as JSON-able data with every secret revealed: only for handing to worker processes."""
        data = self.model_dump(mode="json")
        for name in ("password", "bearer_token"):
            secret = getattr(self, name)
            if secret is not None:
                data[name] = secret.get_secret_value()
        return data

    @model_validator(mode="after")
    def _check_auth(self) -> RegistryConfig:
        if self.password is not None and self.username is None:
            raise ValueError("registry.password is given without registry.username")
        if self.bearer_token is not None and self.username is not None:
            raise ValueError("registry.username (basic auth) and registry.bearer_token exclude each other")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("registry.ssl_keyfile needs registry.ssl_certfile (the client certificate)")
        tls = [n for n in ("ssl_cafile", "ssl_certfile") if getattr(self, n) is not None]
        if tls and not (self.url or "").startswith("https://"):
            raise ValueError(f"registry.{tls[0]} is given but registry.url is not an https:// URL")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"registry.url must be an http:// or https:// URL, got {self.url!r}")
        return self
