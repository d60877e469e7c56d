"""One Prefect test harness (temporary API server and SQLite database) for the flow tests only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
from prefect.testing.utilities import prefect_test_harness


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything here runs under the harness, so `-m "not prefect"` skips the whole directory."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.prefect)


@pytest.fixture(autouse=True, scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Session scope pays the ~8 s server start once; cached task results go to a temporary directory,
    never to the user's ~/.prefect/storage."""
    storage: Path = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}):
        with prefect_test_harness(server_startup_timeout=120):
            yield
