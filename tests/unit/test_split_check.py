"""A ratio split of a class-sorted map-style dataset is named at preflight in one line, with the way out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kbit_core.config import KbitConfig
from kbit_core.datasets import open_source
from kbit_core.jobs import preflight
from kbit_core.jobs.split_check import split_indices, split_label_mismatch

FACTORIES = "tests.integration.user_datasets"


def config(tmp_path: Path, factory: str, **kwargs: object) -> KbitConfig:
    return KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "kbit"),
            "dataset": {
                "name": "torch",
                "factory": f"{FACTORIES}:{factory}",
                "kwargs": {"num_records": 1000, **kwargs},
            },
            "shard": {"split_rates": [0.8, 0.1, 0.1]},
        }
    )


@pytest.mark.parametrize("keep_labels", [True, False], ids=["labels kept", "labels read item by item"])
def test_a_class_sorted_dataset_is_named_with_the_way_out(tmp_path: Path, keep_labels: bool) -> None:
    report = preflight.check_training(config(tmp_path, "sorted_digits", keep_labels=keep_labels))
    (line,) = [w for w in report.warnings if "split" in w]
    assert line.startswith("shard.split_rates=[0.8, 0.1, 0.1]: the val split holds 72 records of classes [8], ")
    assert "the test split holds 100 records of classes [8, 9] that the train split has none of" in line
    assert "\n" not in line
    assert "shuffle the dataset's order in its factory" in line and "torch.utils.data.Subset" in line


def test_a_shuffled_dataset_passes(tmp_path: Path) -> None:
    report = preflight.check_training(config(tmp_path, "digits"))
    assert not [w for w in report.warnings if "split" in w]


def test_split_indices_follow_the_partitions_and_the_split_rates(tmp_path: Path) -> None:
    """Message m goes to partition m % P at offset m // P; each partition's offsets split in order."""
    cfg = config(tmp_path, "digits").override({"produce.partitions": 2, "produce.variant.records_per_message": 2})
    splits = split_indices(cfg, 1000)
    assert sum(len(i) for i in splits.values()) == 1000
    assert len(np.unique(np.concatenate(list(splits.values())))) == 1000
    # 500 messages, 250 per partition: offsets 200..224 are val, i.e. messages 400..449, samples 800..899
    assert splits["val"].tolist() == list(range(800, 900)) and splits["test"].tolist() == list(range(900, 1000))


def test_a_class_mix_far_from_the_training_splits_is_named(tmp_path: Path) -> None:
    """Every class in every split, but the validation split holds mostly one class: the chi-square test names it."""
    cfg = config(tmp_path, "digits")
    source = open_source(cfg.dataset)
    val = split_indices(cfg, source.num_records)["val"]
    labels = np.asarray(source.dataset.labels)
    labels[val[: len(val) * 3 // 4]] = 3
    source.dataset.labels = labels.tolist()
    line = split_label_mismatch(cfg, source)
    assert line is not None and "the val split's class mix is far from the train split's (chi-square p = " in line
