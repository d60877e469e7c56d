"""kbit's local Schema Registry: Apicurio Registry (the pinned build scripts/install_registry.sh unpacks into the
venv), run with a Java 21+ found on this machine, bound to 127.0.0.1, its Confluent-compatible API at
``/apis/ccompat/v7``; schemas in memory, or in an H2 file under the run dir (``registry.local.storage``)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kbit_core.config.registry import CCOMPAT_PATH, LocalRegistryConfig
from kbit_core.errors import KbitError
from kbit_core.service import Service

__all__ = ["RegistryServiceError", "find_java", "local_registry", "registry_app"]

MIN_JAVA = 21
JVM_ROOT = Path("/usr/lib/jvm")
_INSTALL_HINT = "run `bash scripts/run.sh install` (needs Maven: apt-get install maven)"


class RegistryServiceError(KbitError):
    """kbit's local Schema Registry cannot be installed, found, started or reached."""


def registry_app() -> Path:
    """The unpacked Apicurio Registry: ``$KBIT_REGISTRY_HOME``, else ``<venv>/registry/app``."""
    app = Path(os.environ.get("KBIT_REGISTRY_HOME") or Path(sys.prefix) / "registry" / "app")
    if not (app / "quarkus-run.jar").is_file():
        raise RegistryServiceError(
            f"Apicurio Registry is not installed ({app} holds no quarkus-run.jar): {_INSTALL_HINT}"
        )
    return app


@functools.cache
def java_major(java: str) -> int | None:
    """The major version ``java -version`` reports, None when it does not run (asked once a process: a JVM start)."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)', out)
    return int(found.group(1)) if found else None


def _candidates() -> list[tuple[str, str]]:
    """(java, where it came from) in the order they are tried when nothing names one."""
    found = []
    home = os.environ.get("JAVA_HOME")
    if home:
        found.append((str(Path(home) / "bin" / "java"), f"JAVA_HOME={home}"))
    jdks = sorted(JVM_ROOT.glob("*/bin/java"), key=lambda p: _version_key(p.parent.parent.name), reverse=True)
    found += [(str(java), str(java)) for java in jdks]
    on_path = shutil.which("java")
    if on_path:
        found.append((on_path, "java on PATH"))
    return found


def _version_key(name: str) -> int:
    numbers = re.findall(r"\d+", name)
    return int(numbers[0]) if numbers else 0


def find_java(configured: Path | None = None) -> str:
    """A Java 21+ for the registry: ``configured`` (registry.local.java), else $KBIT_REGISTRY_JAVA (either must be
    21+), else the first 21+ of $JAVA_HOME, the JDKs under /usr/lib/jvm (newest first) and java on PATH."""
    named = (str(configured), "registry.local.java") if configured else None
    if named is None and os.environ.get("KBIT_REGISTRY_JAVA"):
        named = (os.environ["KBIT_REGISTRY_JAVA"], "KBIT_REGISTRY_JAVA")
    if named is not None:
        major = java_major(named[0])
        if major is None or major < MIN_JAVA:
            what = "does not run" if major is None else f"is Java {major}"
            raise RegistryServiceError(f"the Schema Registry needs Java {MIN_JAVA}+; {named[1]}={named[0]} {what}")
        return named[0]
    seen = []
    for java, where in _candidates():
        major = java_major(java)
        if major is not None and major >= MIN_JAVA:
            return java
        seen.append(f"{where} ({'does not run' if major is None else f'Java {major}'})")
    raise RegistryServiceError(
        f"the Schema Registry (Apicurio) needs Java {MIN_JAVA}+, found none ({', '.join(seen) or 'no java at all'}): "
        "install e.g. openjdk-21-jre-headless, or set KBIT_REGISTRY_JAVA to a java 21+"
    )


def local_registry(run_dir: Path, local: LocalRegistryConfig, env: dict[str, str] | None = None) -> Service:
    """The local Apicurio Registry as a :class:`Service` (PID file and log in ``run_dir``, ``env`` added to its
    environment), healthy once its Confluent-compatible API answers."""
    app = registry_app()
    management = local.management_port or local.port + 1
    if local.storage == "file":
        database = f"jdbc:h2:file:{run_dir / 'registry' / 'registry'}"
    else:
        database = f"jdbc:h2:mem:kbit-registry-{local.port}"
    url = f"http://{local.host}:{local.port}{CCOMPAT_PATH}"
    argv = [
        find_java(local.java),
        f"-Xmx{local.heap_mb}m",
        "-XX:+UseSerialGC",  # one small JVM on a shared machine: no parallel GC threads
        "-Djava.awt.headless=true",
        f"-Dquarkus.http.host={local.host}",
        f"-Dquarkus.http.port={local.port}",
        f"-Dquarkus.management.host={local.host}",
        f"-Dquarkus.management.port={management}",
        f"-Dapicurio.datasource.url={database}",
        "-Dapicurio.datasource.jdbc.initial-size=2",
        "-Dapicurio.datasource.jdbc.min-size=2",
        '-Dquarkus.log.category."io.quarkus.http.access-log".level=WARN',
        "-jar",
        str(app / "quarkus-run.jar"),
    ]
    return Service(
        "schema-registry",
        run_dir,
        argv,
        marker="quarkus-run.jar",
        env=env or {},
        host=local.host,
        port=local.port,
        ready_ports=(management,),
        health_url=f"{url}/subjects",
        url=url,
        port_setting="registry.local.port, registry.local.management_port",
        error_type=RegistryServiceError,
        prepare=lambda: (run_dir / "registry").mkdir(parents=True, exist_ok=True),
    )
