"""Ray fixtures: one local Ray head per test session (started as `kbit stack up --ray` starts it), joined once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kbit_core.config import KbitConfig
from kbit_core.service import Service
from kbit_core.stack import ray_head
from tests.conftest import free_port


@pytest.fixture(scope="session")
def ray_head_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The stack's Ray head on a free loopback port, stopped (with every Ray process) at the end of the session."""
    cfg = KbitConfig.from_dict({"workdir": str(tmp_path_factory.mktemp("ray-head")),
                                "launch": {"engine": "ray", "ray_head_port": free_port()}})
    head = ray_head(cfg)
    head.start()
    yield head
    import ray

    ray.shutdown()
    head.stop()


@pytest.fixture
def make_ray_config(make_config: Callable[..., KbitConfig], ray_head_service: Service) -> Callable[..., KbitConfig]:
    """``make_config`` with ``launch.engine=ray`` on the session's head."""

    def _make(overrides: dict[str, Any] | None = None, **dotted: Any) -> KbitConfig:
        cfg = make_config(overrides, **dotted)
        return cfg.override({"launch": {"engine": "ray", "ray_head_port": ray_head_service.port}})

    return _make
