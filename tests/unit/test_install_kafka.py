"""scripts/install_kafka.sh without the network: the pom-digest stamp skips Maven, and missing tools are one-line errors."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_kafka.sh"
POM = REPO / "deployments" / "kafka" / "pom.xml"
SPARK_POM = REPO / "deployments" / "spark-kafka" / "pom.xml"
UPGRADE_FROM = re.search(r"^UPGRADE_FROM=(\S+)$", SCRIPT.read_text(), re.M)[1]


def run(dest: Path, path_dirs: list[Path], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "KAFKA_HOME"}
    environ.update(PATH=os.pathsep.join(map(str, path_dirs)), **env)
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(SCRIPT), str(dest)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    """A PATH directory with the shell tools the script uses and a stand-in `java`, but no `mvn`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sha256sum", "cut", "cat", "sed", "mkdir", "rm", "mv", "tail", "dirname", "realpath"):
        found = shutil.which(name)
        assert found, name
        (bin_dir / name).symlink_to(found)
    (bin_dir / "java").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "java").chmod(0o755)
    return bin_dir


def installed(dest: Path, digest: str, previous_digest: str | None = None) -> None:
    """Kafka's jars with the stamp ``digest``, and Spark's Kafka source and the previous release (its stamp
    ``previous_digest``, default: up to date) beside them."""
    (dest / "libs").mkdir(parents=True)
    (dest / "libs" / "kafka_2.13-4.4.0.jar").write_bytes(b"")
    (dest / ".pom-digest").write_text(digest + "\n")
    spark = dest / "spark-source"
    (spark / "libs").mkdir(parents=True)
    (spark / "libs" / "spark-sql-kafka-0-10_2.13-4.2.0.jar").write_bytes(b"")
    (spark / ".pom-digest").write_text(hashlib.sha256(SPARK_POM.read_bytes()).hexdigest() + "\n")
    previous = dest / UPGRADE_FROM
    (previous / "libs").mkdir(parents=True)
    (previous / "libs" / f"kafka_2.13-{UPGRADE_FROM}.jar").write_bytes(b"")
    pom_digest = hashlib.sha256(POM.read_bytes()).hexdigest()
    (previous / ".pom-digest").write_text((previous_digest or f"{pom_digest} -Dkafka.version={UPGRADE_FROM}") + "\n")


def test_a_matching_stamp_skips_maven(tmp_path: Path, tools: Path) -> None:
    installed(tmp_path / "kafka", hashlib.sha256(POM.read_bytes()).hexdigest())
    done = run(tmp_path / "kafka", [tools])
    assert done.returncode == 0 and done.stderr == ""


def test_a_changed_pom_needs_maven_and_says_so(tmp_path: Path, tools: Path) -> None:
    installed(tmp_path / "kafka", "0" * 64)
    done = run(tmp_path / "kafka", [tools])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kbit: installing Apache Kafka 4.4.0 needs Maven 3.6+ (apt-get install maven), or "
        "KAFKA_HOME set to an unpacked Kafka 4.x"
    )


def test_a_missing_previous_release_needs_maven_and_says_so(tmp_path: Path, tools: Path) -> None:
    installed(tmp_path / "kafka", hashlib.sha256(POM.read_bytes()).hexdigest(), previous_digest="0" * 64)
    done = run(tmp_path / "kafka", [tools])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"kbit: installing Apache Kafka {UPGRADE_FROM} needs Maven 3.6+ (apt-get install maven), or "
        "KAFKA_HOME set to an unpacked Kafka 4.x"
    )


def test_missing_java_is_named(tmp_path: Path, tools: Path) -> None:
    (tools / "java").unlink()
    done = run(tmp_path / "kafka", [tools])
    assert done.returncode == 2 and "Apache Kafka needs Java 17 or newer" in done.stderr


def test_kafka_home_replaces_the_install(tmp_path: Path, tools: Path) -> None:
    home = tmp_path / "kafka_2.13-4.4.0"
    assert run(tmp_path / "kafka", [tools], KAFKA_HOME=str(home)).returncode == 2
    (home / "libs").mkdir(parents=True)
    (home / "libs" / "kafka_2.13-4.4.0.jar").write_bytes(b"")
    done = run(tmp_path / "kafka", [tools], KAFKA_HOME=str(home))
    assert done.returncode == 0 and not (tmp_path / "kafka").exists()
