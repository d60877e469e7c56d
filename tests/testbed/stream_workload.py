"""Workload (b) of docs/reliability.md's operators' faults: continuous training (train-cluster: DDP over Spark
standalone, one rank per node host) on a stream kbit's live producer writes into the bed's three brokers while the
job trains, the producer in this process, the job a `kbit train` of its own; faults fire from here at a step of rank
0. The row: the job's outcome and wall time, the longest wait between two steps of a rank, and the ledger's audit of
every record the producer had acknowledged (its stream manifest) against every index the ranks trained."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbit_core import testbed as bed
from kbit_core.config import load_config
from kbit_core.stream.ledger import audit
from kbit_core.stream.live_producer import LiveProducer
from kbit_core.stream.stream_log import StreamLog
from tests.conftest import FAULT_MODELS_DIR, REPO, Background
from tests.testbed.test_cluster_e2e import TRAIN_CLUSTER, bed_sets, run_kbit

GLOBAL_BATCH = 32  # 16 records a rank and step: 2,000 records are ~60 steps
FIRST_RECORDS = 4 * GLOBAL_BATCH  # produced before the job starts; the rest while it trains


def stream_sets(
    state: bed.BedState, workdir: Path, topic: str, records: int, step_s: float, client: str = "confluent"
) -> list[str]:
    """`--set` arguments of a continuous train-cluster run on stream ``topic`` that stops after ``records``, its live
    producer's Kafka client ``client``."""
    clock_dir = workdir / "clock"
    clock_dir.mkdir(parents=True, exist_ok=True)
    extra = {
        "dataset.num_records": 500,  # the stream cycles through them; its index keeps counting
        "train.mode": "continuous",
        "train.global_batch_size": GLOBAL_BATCH,
        "train.model": {"name": "fault_models:step_clock", "kwargs": {"clock_dir": str(clock_dir), "step_s": step_s}},
        "stream.topic": topic,
        "stream.stop_after_records": records,
        "stream.idle_timeout_s": 300,  # a fault holds records back; the trainer waits for them
        "stream.eval_records": 100,
        "stream.eval_every_steps": 1000,
        "stream.report_every_steps": 10,
        "checkpoint.every_steps": 20,
        "tracking.enabled": False,
        "launch.spark_conf": {"spark.executorEnv.PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"},
        "produce.client": client,  # the ranks read with confluent-kafka: kbit refuses continuous mode with another
    }
    return bed_sets(state, workdir, **extra)


def longest_step_wait(clock_dir: Path) -> float:
    """The longest time between two training steps of any rank whose clock is in ``clock_dir``."""
    waits = [0.0]
    for clock in clock_dir.glob("rank-*"):
        times = [float(t) for t in clock.read_text().split()]
        waits += [b - a for a, b in zip(times, times[1:])]
    return max(waits)


def run_stream(
    state: bed.BedState,
    workdir: Path,
    records: int,
    *,
    rate: float,
    step_s: float,
    client: str = "confluent",
    at_step: int = 0,
    fire: Callable[[str], Any] | None = None,
    sets: list[str] | None = None,
) -> dict[str, Any]:
    """The live producer appends ``records`` records at ``rate`` a second to a new stream while continuous training
    trains them (``client``: the producer's Kafka client); ``fire(topic)`` (a fault) runs once rank 0 reached step
    ``at_step``; ``sets``: more ``--set`` arguments of the job's config. The row for the run."""
    topic = f"kbit-bed-stream-{workdir.name[-12:]}-{int(time.time())}"
    sets = [*stream_sets(state, workdir, topic, records, step_s, client), *(sets or [])]
    cfg = load_config(TRAIN_CLUSTER, [value for flag, value in zip(sets[::2], sets[1::2]) if flag == "--set"])
    clock, job_ended = workdir / "clock" / "rank-0", threading.Event()
    producer = Background(_produce_live, LiveProducer(cfg), clock, job_ended, rate, records)
    fault = Background(_fire_at, clock, at_step, job_ended, lambda: fire(topic)) if fire else None
    if fault:  # the measuring's end waits for it (tests/testbed/fault_firing.py)
        fault.name = f"fault at step {at_step}"
    started = time.monotonic()
    try:
        done = run_kbit(
            "train", "--config", str(TRAIN_CLUSTER), "--json", *sets, env={"PYTHONPATH": f"{FAULT_MODELS_DIR}:{REPO}"}
        )
    finally:  # also when the job could not be run: the producer stops, a fault not yet fired never fires
        job_ended.set()
    seconds = time.monotonic() - started
    try:
        produced = producer.result(600)
    except Exception as exc:  # the row says how the producer failed; the next fault still runs
        produced = None
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
    report = fault.result(900) if fault else None  # the cluster whole again
    row: dict[str, Any] = {
        "rc": done.returncode,
        "seconds": round(seconds, 1),
        "stall_s": round(longest_step_wait(workdir / "clock"), 2),
        "producer": {
            "produced": produced.next_index,
            "reconnects": produced.reconnects,
            "seconds": round(produced.seconds, 1),
        }
        if produced
        else {"failed": failure},
        "fault": report.to_dict() if report else None,
    }
    return row | ({"stderr": done.stderr[-2000:]} if done.returncode != 0 else _audited(json.loads(done.stdout)))


def _audited(result: dict[str, Any]) -> dict[str, Any]:
    """The job's outcome and the stream ledger's audit: every record the producer acknowledged against every index
    the ranks trained."""
    log = StreamLog.load(Path(result["stream_manifest"]))
    ledger = audit(dict(enumerate(result["trained"])), log.runs(), log.partitions)
    return {
        "restarts": result.get("restarts"),
        "stop_reason": result.get("stop_reason"),
        "acknowledged": ledger.produced,
        "trained": ledger.trained,
        "lost": ledger.missing_count,
        "twice": ledger.repeated_count,
        "exactly_once": ledger.exactly_once,
        "audit": ledger.summary(),
    }


def _produce_live(producer: LiveProducer, clock: Path, job_ended: threading.Event, rate: float, records: int) -> Any:
    """The stream's first batches (the job waits for its topic before it launches), then, once rank 0 trains, the rest
    at ``rate``: the producer writes throughout the training, and through a fault fired at a step."""
    producer.run(rate=rate, records=min(records, FIRST_RECORDS))
    _fire_at(clock, 1, job_ended, lambda: None)  # until rank 0 trains
    return producer.run(rate=rate, records=records, should_stop=job_ended.is_set)


def _fire_at(clock: Path, step: int, job_ended: threading.Event, fire: Callable[[], Any]) -> Any:
    """``fire()`` once ``clock`` counts ``step`` steps, unless the job ends first (None)."""
    while step and (not clock.exists() or len(clock.read_text().splitlines()) < step):
        if job_ended.wait(0.1):
            return None
    return fire()
