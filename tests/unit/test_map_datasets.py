"""Map-style datasets (a torch Dataset from dataset.factory, arrays in .npy/.npz files) and their loaders without
Kafka (train.data: direct): equal steps on every rank, each epoch's records once, an exact mid-epoch resume at the
same and at another world size, and one-line errors naming the setting and the item."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kbit_core.config import DatasetConfig, KbitConfig
from kbit_core.data.dataset_reader import dataset_manifest
from kbit_core.datasets import open_source
from kbit_core.errors import ConfigError
from kbit_core.jobs.preflight import check_training
from kbit_core.train.rank_data import dataset_loaders

FACTORY = "tests.integration.user_datasets:digits"


def direct_config(tmp_path: Path, num_records: int, remainder: str = "drop", **dataset: object) -> KbitConfig:
    return KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "kbit"),
            "dataset": {"name": "torch", "factory": FACTORY, "kwargs": {"num_records": num_records}, **dataset},
            "shard": {"split_rates": [0.8, 0.1, 0.1], "remainder": remainder, "block_records": 7},
            "train": {"data": "direct", "global_batch_size": 6},
            "tracking": {"enabled": False},
        }
    )


def rank_loaders(cfg: KbitConfig, world_size: int) -> list:
    source = open_source(cfg.dataset, exact=True)
    manifest = dataset_manifest(cfg, source)
    return [dataset_loaders(cfg, source, manifest, rank, world_size).train for rank in range(world_size)]


def epoch_batches(loader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [batch.indices.tolist() for batch in loader.iter_indexed()]


@pytest.mark.parametrize(("remainder", "world_size"), [("drop", 2), ("pad", 3)])
def test_every_rank_takes_the_same_steps_and_each_epoch_is_reshuffled(
    tmp_path: Path, remainder: str, world_size: int
) -> None:
    cfg = direct_config(tmp_path, 151, remainder)  # 121 train records: 1 left over on 2 ranks, 2 short on 3
    loaders = rank_loaders(cfg, world_size)
    first = [epoch_batches(loader, 0) for loader in loaders]
    assert len({len(batches) for batches in first}) == 1 and all(len(b) == len(loaders[0]) for b in first)
    trained = Counter(i for batches in first for batch in batches for i in batch)
    assert set(trained) <= set(range(121))
    padded = loaders[0].plan.report()["train"]["padded"]
    assert sum(trained.values()) == loaders[0].num_records * world_size
    assert (padded, loaders[0].plan.report()["train"]["dropped"]) == ((0, 1) if remainder == "drop" else (2, 0))
    second = epoch_batches(loaders[0], 1)
    assert second != first[0] and sorted(sum(second, [])) != sum(second, [])  # a new, seeded order


@pytest.mark.parametrize("new_world", [2, 3])
def test_a_mid_epoch_resume_trains_the_rest_of_the_epoch_each_record_once(tmp_path: Path, new_world: int) -> None:
    cfg = direct_config(tmp_path, 150)
    old = rank_loaders(cfg, 2)
    whole = [i for loader in old for batch in epoch_batches(loader, 1) for i in batch]
    heads, states = [], []
    for loader in old:  # each old rank trains 5 batches of epoch 1, then the checkpoint takes its state
        loader.set_epoch(1)
        batches = loader.iter_indexed()
        heads += [i for _ in range(5) for i in next(batches).indices.tolist()]
        states.append(loader.state_dict())
        batches.close()
    new = rank_loaders(cfg, new_world)
    for rank, loader in enumerate(new):
        loader.set_epoch(1)
        loader.load_state_dict(states[rank] if new_world == 2 else {"resharded_from": states})
    rest = [epoch_batches(loader, 1) for loader in new]
    # The audit: the records before the checkpoint and after the resume are the epoch's, each exactly once.
    trained = Counter(heads + [i for batches in rest for batch in batches for i in batch])
    assert sorted(trained) == sorted(whole) and set(trained.values()) == {1}
    assert len({len(batches) for batches in rest}) == 1  # equal steps on the new ranks


def test_arrays_from_npz_and_npy_files_read_as_stored(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (20, 3, 8, 8), dtype=np.uint8), rng.permutation(20) % 4
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "images.npy", images[:, 0] / np.float32(255))  # [N, H, W] floats in [0, 1]
    np.save(tmp_path / "dir" / "labels.npy", labels)
    packed = open_source(DatasetConfig(name="arrays", path=tmp_path / "set.npz"))
    assert (packed.image_shape, packed.num_classes, packed.num_records) == ((3, 8, 8), 4, 20)
    _, read, read_labels = next(packed.batches(0, 20, 20))
    assert np.array_equal(read, images) and np.array_equal(read_labels, labels)
    exact = open_source(DatasetConfig(name="arrays", path=tmp_path / "dir"), exact=True)
    _, floats, _ = next(exact.batches(5, 9))
    assert floats.dtype == np.float32 and np.array_equal(floats, images[5:9, :1] / np.float32(255))
    _, quantized, _ = next(open_source(DatasetConfig(name="arrays", path=tmp_path / "dir")).batches(5, 9))
    assert np.array_equal(quantized, images[5:9, :1])  # rounded back to the 8 bits Kafka carries


def test_pil_images_become_channels_first_and_numpy_labels_classes() -> None:
    """The factory returns a list (len and [index] suffice); its pictures' channels-last pixels are transposed."""
    pytest.importorskip("PIL")
    source = open_source(DatasetConfig(name="torch", factory="tests.integration.user_datasets:pictures", num_classes=2))
    _, images, labels = next(source.batches(0, 4))
    assert source.image_shape == (3, 6, 8) and labels.tolist() == [0, 1, 0, 1]
    assert images[3, 0].tolist() == [[3] * 8] * 6 and images[3, 1, 5].tolist() == [5] * 8
    assert images[3, 2, :, 7].tolist() == [7] * 6


def test_distinct_factories_or_arguments_never_share_a_topic() -> None:
    names = {
        DatasetConfig(name="torch", factory=FACTORY, kwargs=kwargs).source_name
        for kwargs in ({}, {"num_records": 10}, {"num_records": 11})
    }
    assert len(names) == 3 and all(name.startswith("torch-") for name in names)


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        (
            {"factory": "tests.integration.user_datasets:digit"},
            r"^dataset.factory='tests.integration.user_datasets:digit': tests.integration.user_datasets has no "
            r"callable 'digit'$",
        ),
        (
            {"factory": "tests.integration.no_such_module:digits"},
            r"^dataset.factory='tests.integration.no_such_module:digits': cannot import "
            r"'tests.integration.no_such_module'",
        ),
        (
            {"kwargs": {"num_records": 300, "bad_item": 299}},
            rf"^dataset.factory='{FACTORY}': item 299 has an image of shape \(1, 27, 28\), item 0 one of "
            r"\(1, 28, 28\); every image must have one shape$",
        ),
        (
            {"kwargs": {"num_records": 300, "bad_label": 2}},
            rf"^dataset.factory='{FACTORY}': item 2 has the label 10, outside the 10 classes 0..9$",
        ),
        (
            {"kwargs": {"num_records": 300, "colour": True}},
            rf"^dataset.factory='{FACTORY}' failed with dataset.kwargs=\{{'num_records': 300, 'colour': True\}}: "
            r"TypeError: ",
        ),
    ],
)
def test_preflight_names_a_bad_factory_or_item_in_one_line(tmp_path: Path, dataset: dict, message: str) -> None:
    cfg = direct_config(tmp_path, 300, **dataset)
    with pytest.raises(ConfigError, match=message) as info:
        check_training(cfg)
    assert "\n" not in str(info.value)


def test_an_item_in_the_middle_that_does_not_fit_is_named_where_it_is_read(tmp_path: Path) -> None:
    cfg = direct_config(tmp_path, 300, kwargs={"num_records": 300, "bad_item": 150})
    check_training(cfg)  # the first and last items fit
    (loader,) = rank_loaders(cfg, 1)
    with pytest.raises(ConfigError, match=rf"^dataset.factory='{FACTORY}': item 150 has an image of shape"):
        epoch_batches(loader, 0)


def test_direct_training_refuses_a_loader_process_that_would_read_kafka(tmp_path: Path) -> None:
    cfg = direct_config(tmp_path, 300).override({"reader.workers": "process"})
    with pytest.raises(ConfigError, match=r"^train.data=direct reads the dataset in the rank; reader.workers=process"):
        check_training(cfg)


def test_config_refuses_direct_training_on_a_live_stream_and_a_torch_dataset_without_factory() -> None:
    with pytest.raises(ConfigError, match="train.data=direct reads a dataset in epochs"):
        KbitConfig.from_dict({"train": {"mode": "continuous", "data": "direct"}})
    with pytest.raises(ValueError, match="dataset.factory names the map-style Dataset of dataset.name 'torch'"):
        DatasetConfig(name="torch")
