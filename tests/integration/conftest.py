"""Integration fixtures: one SparkSession per test session, a per-session TMPDIR to audit, topic producing."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kbit_core.config import KbitConfig
from kbit_core.launch.spark import get_spark, stop_spark
from tests.integration.dataplane_fixtures import produce_topic

__all__ = ["produce_topic"]  # a fixture shared by the data-plane tests


@pytest.fixture(scope="session")
def spark_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spark-session")


@pytest.fixture(scope="session")
def spark(spark_run_dir: Path) -> Iterator[object]:
    """The process's SparkSession (local[2], as the launch defaults), stopped with its JVM at the end."""
    session = get_spark(KbitConfig.from_dict({"workdir": str(spark_run_dir)}))
    yield session
    stop_spark()


@pytest.fixture
def audited_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TMPDIR of its own, so a test can assert that a run left no torchelastic_* or tmp*/train.py there."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def _debris(*roots: Path | None) -> list[str]:
    found: list[str] = []
    for root in roots:
        if root is not None and root.is_dir():
            found += [str(p) for p in root.rglob("torchelastic_*")]
            found += [str(p) for p in root.rglob("train.py")]
    return found


@pytest.fixture
def launch_debris() -> Callable[..., list[str]]:
    """``launch_debris(*dirs)``: leftovers of torchrun (torchelastic_*) and TorchDistributor (tmp*/train.py)."""
    return _debris

