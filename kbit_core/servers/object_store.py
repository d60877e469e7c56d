"""kbit's S3-compatible object store for a team profile: s3proxy (the pinned jar scripts/install_s3proxy.sh puts in
the venv) on Java 17+, its filesystem backend under ``<workdir>/state/s3proxy``, one access key of kbit's with a
generated secret, and the bucket MLflow keeps artifacts in."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kbit_core.errors import KbitError
from kbit_core.servers import logins
from kbit_core.service import Service

__all__ = ["ARTIFACT_BUCKET", "ObjectStoreError", "object_store", "s3_client_env", "s3proxy_jar"]

ARTIFACT_BUCKET = "mlflow"
_INSTALL_HINT = "run `bash scripts/run.sh install` (needs Maven: apt-get install maven)"
# botocore 1.36+ checksums every request by default (aws-chunked bodies, x-amz-checksum-* headers); s3proxy answers
# those with 501 NotImplemented, so MLflow's uploads would fail: checksum only where the operation requires it.
_BOTO_CHECKSUMS = {
    "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
    "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
}


class ObjectStoreError(KbitError):
    """kbit's object store (s3proxy) cannot be found, started or reached."""


def s3proxy_jar() -> Path:
    """The s3proxy jar: ``$KBIT_S3PROXY_JAR``, else ``<venv>/s3proxy/s3proxy.jar``."""
    jar = Path(os.environ.get("KBIT_S3PROXY_JAR") or Path(sys.prefix) / "s3proxy" / "s3proxy.jar")
    if not jar.is_file():
        raise ObjectStoreError(f"s3proxy is not installed (no {jar}): {_INSTALL_HINT}")
    return jar


def store_dir(run_dir: Path) -> Path:
    """The filesystem backend: one folder per bucket, one file per object."""
    return logins.state_dir(run_dir) / "s3proxy" / "data"


def s3_client_env(run_dir: Path, host: str, port: int) -> dict[str, str]:
    """The environment of a process that talks S3 to this store (MLflow's server: boto3 reads these)."""
    return {
        "MLFLOW_S3_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": logins.S3_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": logins.password(run_dir, "s3proxy"),
        "AWS_DEFAULT_REGION": "us-east-1",
        **_BOTO_CHECKSUMS,
    }


def _write_properties(run_dir: Path, host: str, port: int) -> Path:
    """s3proxy's properties (its secret among them, so mode 0600) and the backend folder with the bucket in it."""
    (store_dir(run_dir) / ARTIFACT_BUCKET).mkdir(parents=True, exist_ok=True)
    lines = {
        "s3proxy.endpoint": f"http://{host}:{port}",
        "s3proxy.authorization": "aws-v2-or-v4",
        "s3proxy.identity": logins.S3_ACCESS_KEY,
        "s3proxy.credential": logins.password(run_dir, "s3proxy"),
        "jclouds.provider": "filesystem",
        "jclouds.filesystem.basedir": str(store_dir(run_dir)),
    }
    text = "".join(f"{key}={value}\n" for key, value in lines.items())
    return logins.write_private(logins.credentials_dir(run_dir) / "s3proxy.properties", text)


def object_store(run_dir: Path, host: str, port: int, error_type: type[KbitError] = ObjectStoreError) -> Service:
    """s3proxy as a :class:`Service` (one small JVM), healthy once its port accepts connections."""
    java = shutil.which("java")
    if java is None:
        raise error_type("s3proxy needs Java 17+: install e.g. openjdk-17-jre-headless")
    properties = logins.credentials_dir(run_dir) / "s3proxy.properties"
    argv = [
        java,
        "-Xmx256m",
        "-XX:+UseSerialGC",
        "-Djava.awt.headless=true",
        "-jar",
        str(s3proxy_jar()),
        "--properties",
        str(properties),
    ]
    return Service(
        "s3proxy",
        run_dir,
        argv,
        marker=str(properties),
        host=host,
        port=port,
        url=f"http://{host}:{port}",
        port_setting="stack.s3_port",
        error_type=error_type,
        prepare=lambda: _write_properties(run_dir, host, port),
    )
