"""Continuous training on a user's topic names its labels in the mapping: a stream's cannot be discovered first."""

from __future__ import annotations

from pathlib import Path

import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.jobs.preflight import user_stream_records
from tests.integration.user_topics import FEATURES, USER_MAPPING


def test_a_users_stream_needs_its_labels_named(tmp_path: Path) -> None:
    cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path),
            "source": {"topic": "orders", "mapping": USER_MAPPING},
            "train": {"mode": "continuous"},
        }
    )
    with pytest.raises(ConfigError, match="'orders' needs source.mapping.vocabulary .* or source.mapping.num_classes"):
        user_stream_records(cfg)
    named = user_stream_records(cfg.override({"source.mapping.vocabulary": ["cold", "hot", "warm"]}))
    assert (named.num_classes, named.image_shape, named.record_dtype) == (3, (1, 1, FEATURES), "float32")
    assert user_stream_records(cfg.override({"source.mapping.num_classes": 5})).num_classes == 5
