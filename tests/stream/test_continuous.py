"""Continuous training on a live stream, end to end on the real broker and Spark: exactly-once across a killed
rank, a whole-job restart, world sizes 2 -> 1 -> 3, a broker that crashes and comes back empty, and ranks whose
launcher was killed."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig
from kbit_core.errors import DistributedError
from kbit_core.jobs.train import train
from kbit_core.stream.ledger import audit
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.stream_log import StreamLog
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.worker import RESULT_FILE
from tests.conftest import Background
from tests.stream.stream_fixtures import crash_and_restart, stream_config

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]

BATCH = 32
PARTITIONS = 3  # 3 ranks need 3 partitions: a rank without one is a config error


def continuous_config(tmp_path: Path, broker: EmbeddedBroker, marker_dir: Path) -> KbitConfig:
    # The killing model in every phase (a checkpoint continues only under the same model settings); its marker
    # directory lets it kill once.
    model = {
        "name": "fault_models:kill_each_attempt",
        "kwargs": {"at_step": 8, "marker_dir": str(marker_dir), "times": 1},
    }
    return stream_config(
        tmp_path,
        broker,
        {
            "dataset": {"num_records": 300},
            "produce": {"partitions": PARTITIONS},
            "train": {"mode": "continuous", "global_batch_size": BATCH, "model": model},
            "stream": {
                "eval_every_steps": 10,
                "report_every_steps": 5,
                "eval_records": 200,
                "idle_timeout_s": 90,
                "fill_timeout_s": 0.3,
            },
            "checkpoint": {"dir": "ckpt", "every_steps": 5, "max_restarts": 1},
        },
    )


def run(cfg: KbitConfig, **changes: Any) -> dict[str, Any]:
    return train(cfg.override(changes), progress=False)


def crash_when_training(cfg: KbitConfig, broker: EmbeddedBroker, after_step: int, records: int) -> Background:
    """Once the job writes a checkpoint past ``after_step``, crash the broker and bring it back empty; a few seconds
    later (the trainer finds its offsets gone meanwhile) run the live producer again: it refills what the broker
    lost from its manifest and goes on to ``records``."""
    lineage_dir = cfg.run_dir / "ckpt"

    def crash_then_produce() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            steps = [
                int(c.name.split("-")[1].split(".")[0])
                for lineage in ckpt.list_lineages(lineage_dir)
                for c in ckpt.list_checkpoints(lineage)
            ]
            if max(steps, default=0) > after_step:
                break
            time.sleep(0.2)
        crash_and_restart(broker)
        time.sleep(3)
        LiveProducer(cfg).run(rate=400, records=records)

    return Background(crash_then_produce)


def test_exactly_once_across_a_killed_rank_a_restarted_job_world_sizes_2_1_3_and_a_broker_crash(
    tmp_path: Path, own_broker: EmbeddedBroker, fault_models_importable: None, spark: object
) -> None:
    cfg = continuous_config(tmp_path, own_broker, tmp_path / "kills")
    (tmp_path / "kills").mkdir()
    LiveProducer(cfg).run(rate=2000, records=640)

    # 2 ranks; rank 1 is SIGKILLed at its 8th step, the driver restarts from the step-5 checkpoint
    first = run(cfg, **{"stream.stop_after_records": 320})
    assert (first["restarts"], first["world_size"], first["stop_reason"]) == (1, 2, "records")
    assert len(list((tmp_path / "kills").iterdir())) == 1
    # rank 0 reads partitions 0 and 2 merged in stream-index order, rank 1 partition 1 alone: twice as far
    offsets = first["offsets"]
    assert abs(offsets[0] - offsets[2]) <= 1 and offsets[1] > max(offsets[0], offsets[2])

    # the whole job again, on 1 rank: it continues the stopped run's checkpoint; merging all three partitions in
    # index order, it trains the two behind until every partition stands at the one ahead
    caught_up = PARTITIONS * max(offsets)
    second = run(cfg, **{"stream.stop_after_records": caught_up, "launch.num_processes": 1})
    assert second["world_size"] == 1 and second["records"] >= caught_up
    assert second["records_this_run"] == second["records"] - first["records"]
    assert max(second["offsets"]) - min(second["offsets"]) <= 1

    # 3 ranks, one partition each; 5 steps on (the backlog holds at least 5 batches a rank), the broker crashes;
    # the producer refills it and appends up to 960
    crasher = crash_when_training(cfg, own_broker, second["steps"] + 4, records=960)
    third = run(cfg, **{"stream.stop_after_records": 960, "launch.num_processes": 3, "checkpoint.every_steps": 1})
    crasher.result(60)
    assert (third["world_size"], third["records"], third["stop_reason"]) == (3, 960, "records")
    assert third["resets"] >= 1  # the trainer saw the broker's log fall short of its offsets, and said so

    produced = StreamLog.load(Path(third["stream_manifest"]))
    result = audit({p: runs for p, runs in enumerate(third["trained"])}, produced.runs(), produced.partitions)
    assert result.exactly_once, result.summary()
    assert result.trained == 960
    assert third["offsets"] == [320, 320, 320]
    assert third["freshness_s"]["p50"] is not None and third["test_accuracy"] is not None


def test_the_stop_file_stops_every_rank_at_one_step_with_a_final_checkpoint(
    tmp_path: Path, own_broker: EmbeddedBroker
) -> None:
    cfg = stream_config(
        tmp_path,
        own_broker,
        {
            "produce": {"partitions": 2},
            "train": {"mode": "continuous", "global_batch_size": BATCH, "model": {"name": "mlp"}},
            "stream": {"eval_every_steps": 1000, "eval_records": 100, "idle_timeout_s": 60},
            "checkpoint": {"dir": "ckpt"},
        },
    )
    # produces until the run has stopped (not for a fixed time the test would then wait out)
    stop_producing = threading.Event()
    producer = Background(LiveProducer(cfg).run, rate=100, duration_s=300, should_stop=stop_producing.is_set)
    stop_file = cfg.run_dir / "streams" / f"{cfg.stream.topic}.stop"

    def stop_once_training() -> None:  # rank 0 opens its lineage as it starts; a few seconds later it trains
        deadline = time.monotonic() + 120
        while not list((cfg.run_dir / "ckpt").glob("*/lineage.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(5)
        stop_file.write_text("stop\n")

    stopper = Background(stop_once_training)
    try:
        result = train(cfg, progress=False)
    finally:
        stop_producing.set()
    stopper.result(120)
    producer.result(60)
    assert result["stop_reason"] == "stop file" and result["records"] > 0
    final = Path(result["checkpoint"])
    assert final.name == ckpt.checkpoint_name(result["steps"]) + ".pt"  # the last step, checkpointed at the stop
    assert sum(result["offsets"]) == result["records"]  # positions and counts agree: nothing trained twice


def test_a_rank_whose_steps_took_fewer_records_catches_up_so_a_stream_that_ends_trains_every_record(
    tmp_path: Path, broker: EmbeddedBroker, fault_models_importable: None
) -> None:
    """Seen on the bed under a full disk: one rank's steps took fewer records while its partition waited, and at
    the stream's end it held its last 3 records while the other rank had none, so nobody stepped again until the
    idle timeout. Here the first step takes 2 records on rank 0 and 1 on rank 1 (all there is); the 17 records after
    it leave rank 1 one record behind at the end unless it takes its backlog."""
    clock_dir = tmp_path / "clock"
    clock_dir.mkdir()
    model = {"name": "fault_models:step_clock", "kwargs": {"clock_dir": str(clock_dir)}}
    cfg = stream_config(
        tmp_path,
        broker,
        {
            "produce": {"partitions": 2},
            "train": {"mode": "continuous", "global_batch_size": 8, "model": model},
            "stream": {
                "stop_after_records": 20,
                "idle_timeout_s": 30,  # without the catch-up the job stops here, 19 records trained
                "fill_timeout_s": 0.3,
                "eval_every_steps": 1000,
                "eval_records": 100,
            },
            "launch": {"num_processes": 2},
        },
    )
    LiveProducer(cfg).run(rate=5000, records=3)  # partition 0: indices 0 and 2; partition 1: index 1

    def the_rest_once_training() -> None:
        deadline = time.monotonic() + 120
        while not list(clock_dir.glob("rank-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        LiveProducer(cfg).run(rate=5000, records=20)  # 8 more for partition 0, 9 for partition 1, at once

    producer = Background(the_rest_once_training)
    result = train(cfg, progress=False)
    producer.result(60)
    assert (result["stop_reason"], result["records"]) == ("records", 20)
    log = StreamLog.load(Path(result["stream_manifest"]))
    ledger = audit(dict(enumerate(result["trained"])), log.runs(), log.partitions)
    assert ledger.exactly_once, ledger.summary()


def test_a_sigterm_after_the_ranks_agreed_to_stop_does_not_cost_the_final_checkpoint(
    tmp_path: Path, broker: EmbeddedBroker, fault_models_importable: None
) -> None:
    """Seen in CI: a cancelled run's ranks stopped on the stop file its driver dropped, and the SIGTERM their agent
    forwarded came after that, while they evaluated: it ended them without a final checkpoint. Here every rank
    sends itself SIGTERM in the final test evaluation, after a stop agreed on ``stream.stop_after_records``."""
    model = {"name": "fault_models:sigterm_in_first_evaluation"}
    cfg = stream_config(
        tmp_path,
        broker,
        {
            "produce": {"partitions": 2},
            "train": {"mode": "continuous", "global_batch_size": 8, "model": model},
            "stream": {"stop_after_records": 16, "idle_timeout_s": 60, "eval_every_steps": 1000, "eval_records": 100},
            "checkpoint": {"dir": "ckpt"},
            "launch": {"num_processes": 2},
        },
    )
    LiveProducer(cfg).run(rate=5000, records=16)
    result = train(cfg, progress=False)
    assert (result["stop_reason"], result["records"], result["steps"]) == ("records", 16, 2)
    assert result["test_accuracy"] is not None  # the evaluation the signal came in went on
    final = Path(result["checkpoint"])
    assert final.name == ckpt.checkpoint_name(result["steps"]) + ".pt" and final.is_file()


def cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # exited meanwhile
        return ""


def test_ranks_whose_launcher_is_killed_stop_at_one_step_with_a_final_checkpoint(
    tmp_path: Path, own_broker: EmbeddedBroker
) -> None:
    """torchrun's agent SIGKILLed with the job (its SIGTERM to the ranks and the driver's stop file never come):
    the orphaned ranks stop together, checkpoint and exit, rather than train on for as long as the stream flows."""
    cfg = stream_config(
        tmp_path,
        own_broker,
        {
            "produce": {"partitions": 2},
            "launch": {"engine": "torchrun", "num_processes": 2},
            "train": {"mode": "continuous", "global_batch_size": BATCH, "model": {"name": "mlp"}},
            "stream": {"eval_every_steps": 1000, "eval_records": 100, "idle_timeout_s": 600},
            "checkpoint": {"dir": "ckpt", "every_steps": 3},
        },
    )
    lineage_dir = cfg.run_dir / "ckpt"
    stop_producing = threading.Event()
    producer = Background(LiveProducer(cfg).run, rate=100, duration_s=300, should_stop=stop_producing.is_set)
    job = Background(train, cfg, progress=False)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not any(ckpt.list_checkpoints(lineage) for lineage in ckpt.list_lineages(lineage_dir)):
            assert time.monotonic() < deadline, "no checkpoint: the job never trained"
            time.sleep(0.2)
        (agent,) = [p for p in psutil.Process().children() if "torch.distributed.run" in cmdline(p)]
        ranks = agent.children()
        assert len(ranks) == 2
        agent.kill()
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"ranks {[p.pid for p in alive]} still running a minute after their launcher died"
        with pytest.raises(DistributedError):
            job.result(60)
    finally:
        stop_producing.set()
        # an orphan that did not stop would train on through the next tests (the agent's command names the module too)
        leftovers = ranks + [
            p for p in psutil.Process().children(recursive=True) if "kbit_core.launch.torchrun" in cmdline(p)
        ]
        for process in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        producer.result(60)
    result = json.loads((lineage_dir.parent / RESULT_FILE).read_text())
    assert result["stop_reason"] == "launcher exited" and result["records"] > 0
    (lineage,) = ckpt.list_lineages(lineage_dir)
    assert ckpt.list_checkpoints(lineage)[-1].name == ckpt.checkpoint_name(result["steps"]) + ".pt"  # the stop's
    assert sum(result["offsets"]) == result["records"]
