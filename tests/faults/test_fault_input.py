"""Bad input on the command line and in files: one plain-text error naming the setting, exit code 1, in seconds,
before any broker, topic or Spark is touched (these scenarios point kbit at a port where nothing listens)."""

from __future__ import annotations

import gzip

import pytest

from tests.conftest import free_port
from tests.faults.conftest import assert_failed_cleanly


@pytest.fixture
def nowhere() -> list[str]:
    """--set options aiming at a broker port nobody listens on: reaching the broker would be a different error."""
    return ["--set", f"kafka.embedded.port={free_port()}", "--set", "kafka.request_timeout_s=2"]


def test_error_text_with_markup_characters_prints_as_text(run_kbit, kbit_tmpdir, nowhere):
    # gloo's errors quote "[/__w/pytorch/.../pair.cc:553]"; Rich read such text as a closing tag and crashed.
    outcome = run_kbit("inspect", "[/oops]", *nowhere)
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert "MarkupError" not in outcome.stderr
    assert outcome.error == (
        "TOPIC='[/oops]' is not a legal Kafka topic name: it contains '/[]'; Kafka topic names "
        "may hold only letters, digits, '.', '_' and '-'"
    )


def test_debug_flag_adds_the_traceback(run_kbit, nowhere):
    outcome = run_kbit("--debug", "inspect", "[/oops]", *nowhere)
    assert outcome.returncode == 1
    assert "Traceback (most recent call last)" in outcome.stderr and "kbit_core.errors.ConfigError" in outcome.stderr
    assert "error: TOPIC='[/oops]' is not a legal Kafka topic name" in outcome.stderr


def test_invalid_yaml_names_the_file(run_kbit, kbit_tmpdir, tmp_path, nowhere):
    profile = tmp_path / "broken.yaml"
    profile.write_text("train:\n  epochs: [1\n")
    outcome = run_kbit("produce", "--config", str(profile), *nowhere)
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert outcome.error.startswith(f"config file {profile} is not valid YAML:")


def test_unknown_set_key_names_it(run_kbit, kbit_tmpdir, nowhere):
    outcome = run_kbit("produce", "--set", "train.epoch=3", *nowhere)
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert "invalid kbit configuration (1 error(s)):" in outcome.error
    assert "train.epoch: Extra inputs are not permitted" in outcome.stderr


def test_negative_size_names_the_field(run_kbit, kbit_tmpdir, nowhere):
    outcome = run_kbit("produce", "--records", "-5", *nowhere)
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert "dataset.num_records: Input should be greater than or equal to 1" in outcome.stderr


def test_missing_idx_files_are_named(run_kbit, kbit_tmpdir, tmp_path, nowhere):
    (tmp_path / "mnist").mkdir()
    outcome = run_kbit(
        "produce", "--set", "dataset.name=mnist", "--set", f"dataset.path={tmp_path / 'mnist'}", *nowhere
    )
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert str(tmp_path / "mnist") in outcome.error and "train-images-idx3-ubyte" in outcome.error


def test_cut_off_gzip_idx_reports_its_true_size(run_kbit, kbit_tmpdir, tmp_path, nowhere):
    from tests.unit.test_datasets import make_mnist

    (tmp_path / "mnist").mkdir()
    make_mnist(tmp_path / "mnist", compress=True)
    images = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    whole = images.read_bytes()
    images.write_bytes(whole[: len(whole) // 2])
    assert gzip.decompress(whole)  # the file was whole before it was cut
    outcome = run_kbit(
        "produce", "--set", "dataset.name=mnist", "--set", f"dataset.path={tmp_path / 'mnist'}", *nowhere
    )
    assert_failed_cleanly(outcome, kbit_tmpdir)
    assert outcome.error.startswith(f"{images}: the gzip stream is cut off after ")
    assert f"(the {len(whole) // 2}-byte file is truncated); its header promises 39216 " in outcome.error
