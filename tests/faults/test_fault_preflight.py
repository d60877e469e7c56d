"""Preconditions checked on the driver before producing or launching: each failure a ConfigError (never restarted)
naming the setting, in seconds; what does not stop a run is a warning."""

from __future__ import annotations

import os
import time

import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.jobs import preflight


def config(tmp_path, **sections) -> KbitConfig:
    base = {"workdir": str(tmp_path / "kbit"), "dataset": {"num_records": 2000}, "checkpoint": {"dir": "ckpt"}}
    for key, value in sections.items():
        section, field = key.split("__")
        base.setdefault(section, {})[field] = value
    return KbitConfig.from_dict(base)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"train__model": {"name": "no_such_package.models:factory"}},
            r"^train.model.name='no_such_package.models:factory': cannot import 'no_such_package.models'",
        ),
        (
            {"train__model": {"name": "cnn", "kwargs": {"depth": 3}}},
            r"^train.model: cannot build 'cnn' with kwargs \{'depth': 3\}",
        ),
        (
            {"checkpoint__dir": "in-the-way/ckpt"},
            r"^checkpoint.dir=.*/in-the-way/ckpt cannot be created: "
            r".*/in-the-way is a file, not a directory$",
        ),
        ({"produce__topic": "a/b"}, r"^produce.topic='a/b' is not a legal Kafka topic name: it contains '/'"),
        ({"produce__topic": ".."}, r"^produce.topic='..' is not a legal Kafka topic name: it cannot be '.' or '..'$"),
        (
            {"produce__topic": "t" * 250},
            r"is not a legal Kafka topic name: it has 250 characters; Kafka allows at most "
            r"249$",
        ),
        (
            {"dataset__num_records": 12},
            r"^split 'test' gives each rank no message \(12 records in 12 message\(s\) of 1, "
            r"shard.split_rates=.*, 2 rank\(s\)\)",
        ),
        (
            {"train__global_batch_size": 4000},
            r"^each rank's train shard holds \d+ records, less than one batch of 2000 ",
        ),
        (
            {"checkpoint__resume": "ckpt/gone/step-00000004.pt"},
            r"^checkpoint.resume='ckpt/gone/step-00000004.pt' is not a complete checkpoint",
        ),
        (
            {"train__loss": "tests.integration.user_pieces:smoothed_los"},
            r"^train.loss='tests.integration.user_pieces:smoothed_los': tests.integration.user_pieces has no "
            r"callable 'smoothed_los'$",
        ),
        (
            {"train__metrics": {"top2": "tests.integration.user_piece:top2"}},
            r"^train.metrics.top2='tests.integration.user_piece:top2': cannot import 'tests.integration.user_piece'",
        ),
        (
            {"train__optim": {"name": "torch.optim:RMSProp"}},
            r"^train.optim.name='torch.optim:RMSProp': torch.optim has no callable 'RMSProp'$",
        ),
        (
            {"train__optim": {"schedule": "tests.integration.user_pieces:halve_every"}},
            r"^train.optim.schedule='tests.integration.user_pieces:halve_every': tests.integration.user_pieces has "
            r"no callable 'halve_every'$",
        ),
        (
            {"train__tensor_parallel": {"size": 2}},
            r"^train.tensor_parallel needs a transformer .* has no EncoderBlock$",
        ),
        (
            {"dataset__name": "synthetic_tokens", "train__model": {"name": "cnn"}},
            r"^train.model.name='cnn' classifies images, but the dataset's records are token sequences of shape "
            r"\(32,\); use token_transformer$",
        ),
        (
            {"dataset__name": "synthetic_tokens", "train__model": {"name": "token_transformer"}},
            r"^train.model: its token embedding holds 16 ids, but the dataset has dataset.vocab_size=1000; set "
            r"train.model.kwargs.vocab_size >= 1000$",
        ),
    ],
    ids=[
        "misspelled-loss",
        "misspelled-metric-module",
        "misspelled-optimizer",
        "misspelled-scheduler",
        "unknown-model",
        "bad-model-kwargs",
        "unwritable-checkpoint-dir",
        "illegal-topic",
        "dot-dot-topic",
        "long-topic",
        "split-without-data",
        "batch-larger-than-shard",
        "missing-resume-checkpoint",
        "tensor-parallel-without-a-transformer",
        "image-model-on-tokens",
        "embedding-smaller-than-the-vocabulary",
    ],
)
def test_training_preconditions_fail_fast_naming_the_setting(tmp_path, record_property, sections, message):
    (tmp_path / "kbit").mkdir()
    (tmp_path / "kbit" / "in-the-way").write_text("a file where a directory is needed")
    cfg = config(tmp_path, **sections)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=message):
        preflight.check_training(cfg)
    record_property("seconds", round(time.monotonic() - started, 2))
    assert not (tmp_path / "kbit" / "spark").exists(), "nothing was launched"


def test_too_little_disk_for_the_kept_checkpoints(tmp_path):
    cfg = config(tmp_path, checkpoint__keep_last=10**9)
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.keep_last=1000000000, plus the one being written, of about "
        r"[\d,.]+ MB each\) needs about [\d,.]+ MB but only [\d,.]+ MB are free",
    ):
        preflight.check_training(cfg)


def test_more_records_per_message_than_records_is_a_warning(tmp_path):
    cfg = config(
        tmp_path,
        dataset__num_records=50,
        produce__variant={"records_per_message": 64},
        shard__split_rates=[1.0],
        launch__num_processes=1,
        train__global_batch_size=8,
    )
    report = preflight.check_training(cfg)
    assert report.warnings == [
        "produce.variant.records_per_message=64 is more than the 50 records of the dataset: the topic holds a "
        "single, partly filled message",
        "produce.partitions=2 but only 1 message(s): 1 partition(s) stay empty",
    ]
    assert report.checkpoint_bytes > 0


def test_benchmark_preconditions_cover_the_whole_matrix(tmp_path):
    cfg = KbitConfig.from_dict(
        {"workdir": str(tmp_path / "kbit"), "dataset": {"num_records": 100}, "bench": {"world_sizes": [1, 64]}}
    )
    with pytest.raises(ConfigError, match=r"gives each rank no message \(100 records .* 64 rank\(s\)\)"):
        preflight.check_benchmark(cfg)
    preflight.check_benchmark(cfg.override({"bench.world_sizes": [1, 2]}))


def test_ranks_far_beyond_the_cores_are_warned_of_before_the_benchmark(tmp_path):
    """Issue 21 defect 9: bench.world_sizes=[2,64] on 2 cores ran over 300 s without a word."""
    cores = len(os.sched_getaffinity(0))
    crowded = 4 * cores + 1
    cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path / "kbit"),
            "dataset": {"num_records": 20_000},
            "bench": {"world_sizes": [1, crowded], "batch_sizes": [256]},
        }
    )
    report = preflight.check_benchmark(cfg)
    assert [w for w in report.warnings if "CPU core" in w] == [
        f"bench.world_sizes={crowded} ranks on {cores} CPU core(s) of this machine ({crowded / cores:.0f} per core): "
        "each rank gets a small share of a core and its start alone takes seconds, so the run takes far longer than "
        f"on fewer ranks; use at most {4 * cores} here"
    ]
    assert not [
        w for w in preflight.check_benchmark(cfg.override({"bench.world_sizes": [1, 2]})).warnings if "core" in w
    ]
