"""The Apache Kafka releases installed for kbit (the pinned broker's jars, and the previous release the test bed's
rolling upgrade starts on: scripts/install_kafka.sh), the Java that runs them, and running one of their tools.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kbit_core.errors import BrokerError

__all__ = ["installed_kafka_versions", "java_binary", "kafka_libs", "kafka_version", "run_kafka_tool"]

# How long one of Kafka's command-line tools may run by default.
TOOL_TIMEOUT_S = 600.0

_INSTALL_HINT = (
    "run `bash scripts/run.sh install` (needs Java 17+ and Maven: apt-get install openjdk-17-jre-headless "
    "maven), or set KAFKA_HOME to an unpacked Apache Kafka 4.x distribution"
)


def kafka_libs(version: str | None = None) -> Path:
    """The directory of the Kafka jars: ``$KAFKA_HOME/libs``, else ``$KBIT_KAFKA_LIBS``, else ``<venv>/kafka/libs``.
    Given another ``version`` than those jars', that release's: ``<venv>/kafka/<version>/libs`` (the previous release
    scripts/install_kafka.sh installs for the test bed's rolling upgrade)."""
    home = os.environ.get("KAFKA_HOME")
    if home:
        libs, where = Path(home) / "libs", f"KAFKA_HOME={home}"
    else:
        libs = Path(os.environ.get("KBIT_KAFKA_LIBS") or Path(sys.prefix) / "kafka" / "libs")
        where = str(libs)
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"Apache Kafka's jars are not installed ({where} holds no kafka_2.13-*.jar): {_INSTALL_HINT}")
    if version is None or version == kafka_version(libs):
        return libs
    other = Path(sys.prefix) / "kafka" / version / "libs"
    if not (other / f"kafka_2.13-{version}.jar").is_file():
        installed = ", ".join(sorted({kafka_version(libs), *installed_kafka_versions()}))
        raise BrokerError(
            f"Apache Kafka {version}'s jars are not installed ({other} holds no kafka_2.13-{version}.jar); installed: "
            f"{installed}. `bash scripts/run.sh install` installs the release the bed's rolling upgrade starts on"
        )
    return other


def installed_kafka_versions() -> list[str]:
    """The other Apache Kafka releases installed beside the broker's (``<venv>/kafka/<version>/libs``), oldest first."""
    found = [p.parent.name for p in (Path(sys.prefix) / "kafka").glob("*/libs") if any(p.glob("kafka_2.13-*.jar"))]
    return sorted(found, key=lambda v: tuple(int(x) if x.isdigit() else 0 for x in v.split(".")))


def kafka_version(libs: Path | None = None) -> str:
    """The broker's version from its jar's name, e.g. '4.4.0'."""
    jar = next(iter(sorted((libs or kafka_libs()).glob("kafka_2.13-*.jar"))))
    return jar.name.removeprefix("kafka_2.13-").removesuffix(".jar")


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on PATH, checked to be Java 17 or newer."""
    home = os.environ.get("JAVA_HOME")
    java = (
        str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").is_file() else shutil.which("java")
    )
    if java is None:
        raise BrokerError(
            "Apache Kafka needs Java 17 or newer: install e.g. openjdk-17-jre-headless (or set JAVA_HOME)"
        )
    return _checked_java(java)


@functools.cache
def _checked_java(java: str) -> str:
    """``java`` once it said it is Java 17 or newer; asked once a process (`java -version` is a JVM start, and the
    nodes of a cluster start together)."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError) as exc:
        raise BrokerError(f"cannot run {java} -version: {exc}") from None
    found = re.search(r'version "(\d+)', out)
    if found is None or int(found.group(1)) < 17:
        raise BrokerError(f"Apache Kafka needs Java 17 or newer; {java} is {out.splitlines()[0] if out else 'unknown'}")
    return java


def run_kafka_tool(tool: str, args: list[str], timeout_s: float = TOOL_TIMEOUT_S, version: str | None = None) -> str:
    """Run ``org.apache.kafka.tools.<tool>`` from the installed Kafka jars (release ``version``'s, given one); its
    stdout. BrokerError with the tool's last output lines, on one line, when it fails."""
    command = [java_binary(), "-Xmx512m", "-cp", f"{kafka_libs(version)}/*", f"org.apache.kafka.tools.{tool}", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BrokerError(f"Kafka's {tool} did not finish within {timeout_s:g}s") from None
    if done.returncode:
        tail = " | ".join(line.strip() for line in (done.stdout + done.stderr).strip().splitlines()[-5:])
        raise BrokerError(f"Kafka's {tool} failed (exit {done.returncode}): {tail}")
    return done.stdout
