"""The Ray engine's settings: engine and address validation, the benchmark's engine dimension, loopback detection."""

from __future__ import annotations

import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.jobs.benchmark import matrix
from kbit_core.launch.ray_train import _is_local


def test_engine_defaults_to_spark_and_ray_takes_an_address() -> None:
    assert KbitConfig().launch.engine == "spark"
    for address in ("auto", "127.0.0.1:6390", "ray://head.example:10001", "[::1]:6390"):
        assert KbitConfig.from_dict({"launch": {"engine": "ray", "ray_address": address}}).launch.ray_address == address


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("ray_address", "head.example", "launch.ray_address='head.example'"),
        ("ray_resources_per_worker", {"CPU": -1}, "launch.ray_resources_per_worker has negative amounts"),
        ("engine", "dask", "launch.engine"),
    ],
)
def test_bad_ray_settings_name_the_field(field: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError, match="launch") as info:
        KbitConfig.from_dict({"launch": {"engine": "ray", field: value}})
    assert named in str(info.value)


def test_engines_are_a_matrix_dimension_named_only_when_swept() -> None:
    one = KbitConfig.from_dict({"launch": {"engine": "ray"}, "bench": {"variants": [{"format": "avro"}]}})
    assert [(c.name, c.engine) for c in matrix(one)] == [("avro_list_lz4.confluent", "ray")]
    both = one.override({"bench.engines": ["spark", "ray"]})
    assert [(c.name, c.engine) for c in matrix(both)] == [
        ("avro_list_lz4.confluent.spark", "spark"),
        ("avro_list_lz4.confluent.ray", "ray"),
    ]


def test_local_ray_addresses_are_recognised() -> None:
    assert _is_local("127.0.0.1:6390") and _is_local("ray://localhost:10001") and _is_local("[::1]:6390")
    assert not _is_local("10.0.0.5:6390") and not _is_local("ray://head.example:10001") and not _is_local("auto")
