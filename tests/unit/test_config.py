"""One test per validation rule of the typed configuration, plus the YAML and dict round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kbit_core.config import (
    BenchConfig,
    DataVariant,
    KbitConfig,
    LaunchConfig,
    ShardConfig,
    default_bench_variants,
    load_config,
    parse_overrides,
)
from kbit_core.errors import ConfigError
from kbit_core.jobs.benchmark import matrix
from kbit_core.kafka.settings import mask
from kbit_core.tracking.params import config_params


def test_defaults_validate_and_round_trip() -> None:
    cfg = KbitConfig()
    assert KbitConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_is_rejected_with_its_location() -> None:
    with pytest.raises(ConfigError, match=r"train\.epoch"):
        KbitConfig.from_dict({"train": {"epoch": 3}})


def test_split_rates_must_sum_to_one() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        ShardConfig(split_rates=[0.5, 0.4])


def test_split_rates_at_most_three() -> None:
    with pytest.raises(ValueError, match="1 to 3"):
        ShardConfig(split_rates=[0.25] * 4)


def test_split_rates_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ShardConfig(split_rates=[1.0, 0.0])


def test_cluster_mode_needs_enough_local_slots() -> None:
    with pytest.raises(ValueError, match="barrier slots"):
        LaunchConfig(master="local[1]", num_processes=2, local_mode=False)
    LaunchConfig(master="local[1]", num_processes=2, local_mode=True)


def test_fp16_needs_gpu() -> None:
    with pytest.raises(ConfigError, match="fp16"):
        KbitConfig.from_dict({"train": {"precision": "fp16"}})


def test_global_batch_not_smaller_than_world() -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        KbitConfig.from_dict({"train": {"global_batch_size": 1}, "launch": {"num_processes": 2}})


def test_sasl_needs_mechanism_and_user() -> None:
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        KbitConfig.from_dict({"kafka": {"bootstrap_servers": "k:9093", "security_protocol": "SASL_SSL"}})


def test_deepspeed_offload_param_needs_stage3() -> None:
    with pytest.raises(ConfigError, match="zero_stage 3"):
        KbitConfig.from_dict({"deepspeed": {"enabled": True, "zero_stage": 2, "offload_param": True}})


def test_idx_dataset_needs_path() -> None:
    with pytest.raises(ConfigError, match="dataset.path"):
        KbitConfig.from_dict({"dataset": {"name": "mnist"}})


def test_password_is_masked_in_dumps_and_revealed_only_for_workers() -> None:
    cfg = KbitConfig.from_dict(
        {
            "kafka": {
                "bootstrap_servers": "k:9093",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "hunter2",
            }
        }
    )
    assert "hunter2" not in str(cfg.to_dict())
    assert "hunter2" not in repr(cfg)
    assert cfg.to_secret_dict()["kafka"]["sasl_password"] == "hunter2"


def test_a_malformed_set_value_names_its_setting_in_one_line() -> None:
    """Issue 21 defect 8: YAML's own error named neither the setting nor the --set it came from."""
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.epochs=2", 'train.model={"name": cnn'])
    message = str(raised.value)
    assert message.startswith("--set train.model: the value '{\"name\": cnn' is not valid YAML (expected ',' or '}'")
    assert "\n" not in message


OAUTH_CONFIG = "principal=alice clientSecret=OAUTHSECRET1 scope=train"
JAAS_CONFIG = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="alice" password="JAAS-PW2";'


def test_a_credential_inside_an_extra_value_is_masked_by_value() -> None:
    """Issue 21 defect 1: `sasl.oauthbearer.config` is no credential by name, but its value carries one."""
    url = "https://svc:URLSECRET3@idp.example/token"
    extra = (
        f'kafka.extra={{"sasl.oauthbearer.config": "{OAUTH_CONFIG}", "sasl.oauthbearer.token.endpoint.url": "{url}", '
    )
    cfg = load_config(None, [extra + '"sasl.kerberos.service.name": "kafka"}'])
    dumped = json.dumps(cfg.to_dict()) + repr(cfg) + json.dumps(config_params(cfg)) + cfg.model_dump_json()
    assert [s for s in ("OAUTHSECRET1", "URLSECRET3") if s in dumped] == []
    assert config_params(cfg)["kafka.extra.sasl.kerberos.service.name"] == "kafka"  # no credential: stays readable
    assert cfg.kafka.client_extra()["sasl.oauthbearer.config"] == OAUTH_CONFIG  # the client still gets it


def test_mask_hides_credentials_inside_values_and_keeps_the_rest_readable() -> None:
    overrides = {"kafka": {"extra": {"sasl.oauthbearer.config": OAUTH_CONFIG, "x": JAAS_CONFIG}}, "train.epochs": 2}
    masked = mask(overrides)
    assert masked["kafka"]["extra"]["sasl.oauthbearer.config"] == "principal=alice clientSecret=*** scope=train"
    assert masked["kafka"]["extra"]["x"].endswith('username="alice" password=***;')
    assert masked["train.epochs"] == 2
    assert mask({"uri": "http://u:pw@host:5000/x"}) == {"uri": "http://u:***@host:5000/x"}
    assert mask({"bootstrap.servers": "a:9092,b:9092", "token.key": "k"}) == {
        "bootstrap.servers": "a:9092,b:9092",
        "token.key": "***",
    }


def test_default_matrix_holds_the_original_four_and_both_layouts() -> None:
    names = {v.name for v in default_bench_variants()}
    assert {"avro_list_lz4", "avro_list_none", "json_list_lz4", "json_list_none"} <= names
    assert {"protobuf_bytes_lz4", "bson_list_none", "raw_bytes_lz4"} <= names
    assert "raw_list_lz4" not in names
    assert BenchConfig().iterations == 30


def test_variant_name_includes_records_per_message() -> None:
    assert (
        DataVariant(format="raw", layout="bytes", compression="none", records_per_message=8).name == "raw_bytes_none_x8"
    )


def test_yaml_extends_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("profile: base\ntrain:\n  epochs: 5\n  global_batch_size: 32\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nprofile: child\ntrain:\n  epochs: 7\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.optim.lr=0.01", "kafka.client=kafka-python"])
    assert (cfg.profile, cfg.train.epochs, cfg.train.global_batch_size) == ("child", 7, 32)
    assert cfg.train.optim.lr == 0.01 and cfg.kafka.client == "kafka-python"


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_override_syntax_error() -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["train.epochs"])


def test_topic_name_is_derived_from_dataset_and_variant() -> None:
    cfg = KbitConfig()
    topic = cfg.produce.topic_for(cfg.dataset)
    assert topic == "kbit.synthetic_digits.s0.n70000.avro_list_lz4.p2"


def test_shipped_profiles_validate() -> None:
    root = Path(__file__).resolve().parents[2] / "deployments"
    ray_launcher = root / "ray"  # Ray's own cluster launcher config (`ray up`), not a kbit profile
    for path in sorted(root.rglob("*.yaml")):
        if ray_launcher not in path.parents:
            load_config(path)


@pytest.mark.parametrize(
    ("kafka", "match"),
    [
        ({"bootstrap_servers": "k:9093", "ssl_cafile": "/ca.pem"}, "ssl_cafile given but security_protocol=PLAINTEXT"),
        ({"bootstrap_servers": "k:9093", "sasl_password": "x"}, "sasl_\\* settings are given"),
        ({"security_protocol": "SSL"}, "embedded broker speaks PLAINTEXT only"),
    ],
)
def test_inconsistent_kafka_security_is_rejected(kafka: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KbitConfig.from_dict({"kafka": kafka})


def test_gpu_on_a_cluster_needs_a_discovery_script_on_the_executors() -> None:
    driver = {"driver_host": "10.1.0.5", "driver_bind_address": "0.0.0.0"}
    with pytest.raises(ValueError, match="gpu_discovery_script"):
        LaunchConfig(master="spark://h:7077", local_mode=False, use_gpu=True, **driver)
    LaunchConfig(master="spark://h:7077", local_mode=False, use_gpu=True, gpu_discovery_script="/opt/gpus.sh", **driver)


def test_gpu_cluster_mode_on_plain_local_master_rejected_even_without_task_amount() -> None:
    with pytest.raises(ValueError, match="hang"):
        LaunchConfig(master="local[2]", local_mode=False, use_gpu=True)


def test_librdkafka_extras_refused_for_kafka_python() -> None:
    with pytest.raises(ConfigError, match="kafka.extra holds librdkafka options"):
        KbitConfig.from_dict({"kafka": {"client": "kafka-python", "extra": {"fetch.wait.max.ms": 10}}})
    KbitConfig.from_dict({"kafka": {"extra": {"fetch.wait.max.ms": 10}}})


@pytest.mark.parametrize("setting", ["driver_host", "driver_bind_address"])
def test_a_cluster_master_with_a_loopback_driver_address_names_the_setting(setting: str) -> None:
    launch = {
        "master": "spark://10.213.7.1:7077",
        "local_mode": False,
        "driver_host": "10.213.7.1",
        "driver_bind_address": "10.213.7.1",
        setting: "127.0.0.1",
    }
    with pytest.raises(ConfigError, match=rf"launch\.{setting}=127\.0\.0\.1 is a loopback address"):
        KbitConfig.from_dict({"launch": launch})


def test_local_masters_keep_the_driver_on_loopback() -> None:
    launch = KbitConfig().launch
    assert (launch.driver_host, launch.driver_bind_address) == ("127.0.0.1", "127.0.0.1")


def test_override_takes_dotted_and_nested_keys_validates_and_keeps_secrets() -> None:
    cfg = KbitConfig.from_dict(
        {
            "kafka": {
                "bootstrap_servers": "k:9093",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "hunter2",
            }
        }
    )
    changed = cfg.override({"launch.num_processes": 4, "train": {"global_batch_size": 128}, "reader.mode": "eager"})
    assert (changed.launch.num_processes, changed.train.global_batch_size, changed.reader.mode) == (4, 128, "eager")
    assert changed.kafka.sasl_password.get_secret_value() == "hunter2"
    assert cfg.launch.num_processes == 2  # the original is untouched
    with pytest.raises(ConfigError, match="launch.num_processes"):
        cfg.override({"launch.num_processes": 0})
    resumed = changed.resuming(Path("/ckpt/lineage-1"))
    assert resumed.checkpoint.resume == "/ckpt/lineage-1" and resumed.launch.num_processes == 4
    assert resumed.kafka.sasl_password.get_secret_value() == "hunter2" and changed.checkpoint.resume == "none"


def test_the_rank_hand_off_round_trips_the_config_with_paths_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = KbitConfig.from_dict(
        {
            "profile": "p",
            "train": {"epochs": 5},
            "workdir": "runs/a",
            "kafka": {"bootstrap_servers": "k:9093", "security_protocol": "SSL", "ssl_cafile": "certs/ca.pem"},
        }
    )
    hand_off = cfg.to_secret_json()
    monkeypatch.chdir("/")  # a rank on another host starts elsewhere
    rank_cfg = KbitConfig.from_json(hand_off)
    assert rank_cfg.run_dir == tmp_path / "runs/a" and rank_cfg.kafka.ssl_cafile == tmp_path / "certs/ca.pem"
    assert rank_cfg.train == cfg.train and rank_cfg.profile == "p"


def test_the_broker_kind_says_where_tansu_workarounds_apply() -> None:
    # the local broker is Apache Kafka by default; an external cluster is real Kafka unless kafka.broker_kind says tansu
    assert KbitConfig.from_dict({}).kafka.embedded.broker == "apache-kafka"
    assert not KbitConfig.from_dict({}).kafka.tansu
    assert KbitConfig.from_dict({"kafka": {"embedded": {"broker": "tansu"}}}).kafka.tansu
    assert not KbitConfig.from_dict(
        {"kafka": {"bootstrap_servers": "k:9092", "embedded": {"broker": "tansu"}}}
    ).kafka.tansu
    assert KbitConfig.from_dict({"kafka": {"bootstrap_servers": "k:9092", "broker_kind": "tansu"}}).kafka.tansu


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"train": {"pipeline": {"stages": 2}}}, "runs on DeepSpeed: set deepspeed.enabled=true"),
        (
            {"train": {"pipeline": {"stages": 2}}, "deepspeed": {"enabled": True, "zero_stage": 2}},
            "runs on DeepSpeed: set deepspeed.enabled=true, zero_stage <= 1",
        ),
        (
            {"train": {"pipeline": {"stages": 2}}, "deepspeed": {"enabled": True}, "launch": {"num_processes": 3}},
            "launch.num_processes=3 is not a multiple of train.pipeline.stages=2",
        ),
        (
            {
                "train": {"global_batch_size": 36, "pipeline": {"stages": 2, "micro_batches": 4}},
                "deepspeed": {"enabled": True},
                "launch": {"num_processes": 4},
            },
            "train.global_batch_size=36 does not split into 2 data-parallel ranks × train.pipeline.micro_batches=4",
        ),
        (
            {"train": {"pipeline": {"stages": 2}, "grad_accum_steps": 2, "ema_decay": 0.9}},
            r"does not work with train.grad_accum_steps > 1 \(use train.pipeline.micro_batches\), train.ema_decay",
        ),
        ({"checkpoint": {"keep_best": "val_loss"}}, "checkpoint.keep_best needs checkpoint.dir"),
        (
            {"train": {"tensor_parallel": {"size": 2}}, "deepspeed": {"enabled": True}},
            "train.tensor_parallel.size=2 runs on torch's DTensor: set deepspeed.enabled=false",
        ),
        (
            {"train": {"tensor_parallel": {"size": 2}}, "launch": {"num_processes": 3}},
            "launch.num_processes=3 is not a multiple of train.tensor_parallel.size=2",
        ),
        (
            {"train": {"tensor_parallel": {"size": 2}, "global_batch_size": 33}, "launch": {"num_processes": 4}},
            "train.global_batch_size=33 does not split into 2 data-parallel ranks",
        ),
        (
            {"train": {"tensor_parallel": {"size": 2}, "grad_clip_norm": 1.0, "ema_decay": 0.9}},
            r"tensor_parallel.size=2 does not work with train.ema_decay, train.grad_clip_norm \(the norm",
        ),
    ],
)
def test_pipeline_and_keep_best_settings_that_cannot_work_are_named(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KbitConfig.from_dict(sections)


def test_keep_best_direction_follows_the_metric_name() -> None:
    def higher(**checkpoint) -> bool:
        return KbitConfig.from_dict({"checkpoint": {"dir": "c", **checkpoint}}).checkpoint.best_is_higher()

    assert higher(keep_best="val_accuracy") and higher(keep_best="val_top2")
    assert not higher(keep_best="val_loss") and not higher(keep_best="val_error")
    assert not higher(keep_best="val_top2", keep_best_mode="min")


def test_kbit_set_reaches_every_profile_and_set_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KBIT_SET", "kafka.embedded.port=29092 'dataset.num_records=600' launch.ray_head_port=6391")
    cfg = load_config(Path(__file__).resolve().parents[2] / "deployments/train-smoke.yaml", ["dataset.num_records=700"])
    assert cfg.kafka.embedded.port == 29092 and cfg.launch.ray_head_port == 6391
    assert cfg.dataset.num_records == 700, "--set comes after KBIT_SET"
    assert cfg.profile == "train-smoke", "the profile's own values stay"
    monkeypatch.setenv("KBIT_SET", "train.epochs")
    with pytest.raises(ConfigError, match=r"^KBIT_SET: override 'train.epochs' is not of the form section.key=value$"):
        load_config(None)


def test_records_per_message_is_a_matrix_dimension_of_the_benchmark() -> None:
    raw, avro = (DataVariant(format=f, layout="bytes", compression="none") for f in ("raw", "avro"))
    cfg = KbitConfig().override({"bench.variants": [raw.model_dump(), avro.model_dump()]})
    assert [c.name for c in matrix(cfg)] == ["raw_bytes_none.confluent", "avro_bytes_none.confluent"]
    grouped = cfg.override({"bench.records_per_message": [1, 8, 64]})
    cells = matrix(grouped)
    assert [c.variant.records_per_message for c in cells] == [1, 8, 64, 1, 8, 64]
    assert cells[2].name == "raw_bytes_none_x64.confluent"
    # crossing again what is already crossed adds nothing (a config that went through a dump and back)
    again = grouped.override({"bench.variants": [v.model_dump() for v in grouped.bench.matrix_variants()]})
    assert [v.name for v in again.bench.matrix_variants()] == [v.name for v in grouped.bench.matrix_variants()]
    assert config_params(grouped, "benchmark")["bench.records_per_message"] == "[1, 8, 64]"
    with pytest.raises(ConfigError, match="records_per_message"):
        cfg.override({"bench.records_per_message": [0]})


def test_the_nightly_profile_measures_grouped_messages() -> None:
    nightly = load_config(Path(__file__).parents[2] / "deployments/profiles/nightly.yaml")
    assert nightly.bench.records_per_message == [1, 8, 64]
    assert len(nightly.bench.matrix_variants()) == 3 * len(nightly.bench.variants)
