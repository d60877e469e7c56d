"""Stream fixtures: a broker of the test's own, which it may crash and restart (helpers: stream_fixtures.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kbit_core.brokers.broker import EmbeddedBroker
from tests.conftest import free_port


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker of this test's own (memory only: a restart comes back empty)."""
    broker = EmbeddedBroker(tmp_path / "broker", port=free_port())
    broker.start()
    yield broker
    broker.stop()
