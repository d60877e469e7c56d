"""tests/unit is the fast tier (`scripts/run.sh fast`): pure tests that start no service. A unit test that asks for
the broker, Spark, a Ray head or the test bed, or starts any kbit Service, fails here: it belongs in another folder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import pytest

from kbit_core.service import Service

SERVICE_FIXTURES = ("broker", "apache_kafka", "tansu", "spark", "ray_head_service", "testbed")


def refuse(what: str) -> NoReturn:
    pytest.fail(f"tests/unit is the fast tier and starts no service: a test using {what} belongs in another folder")


@pytest.fixture(autouse=True)
def no_service_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # every start goes through spawn: Service.start and start_together alike
    monkeypatch.setattr(Service, "spawn", lambda self, *args, **kwargs: refuse(f"the {self.name} service"))


def _refusing(name: str) -> Callable[[], Any]:
    @pytest.fixture(name=name)
    def fixture() -> Any:
        refuse(f"the {name} fixture")

    return fixture


# The suite's service fixtures (tests/conftest.py, tests/testbed/conftest.py), overridden for this folder.
for _name in SERVICE_FIXTURES:
    globals()[f"refuse_{_name}"] = _refusing(_name)
