"""The continuous training loop: every rank steps together on what arrives, until told to stop, then checkpoints.

Each iteration every rank fills its batch from its partitions (waiting at most ``stream.fill_timeout_s``), then
the ranks exchange how many records each has and whether any must stop. If any rank has none, nobody steps (the
others keep theirs buffered), so DDP/DeepSpeed always see equal step counts; a rank that trained fewer records than
another takes more of what it holds, so that at a stream's end the ranks run dry together. A stop (duration,
records, the stop file, SIGTERM/SIGINT, the launcher's exit, or ``stream.idle_timeout_s`` without data) is agreed
the same way and ends with a final evaluation and checkpoint. Checkpoints carry every partition's next offset and
trained index runs with the model, so a resume under any world size continues exactly there.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kbit_core.config import KbitConfig
from kbit_core.data.batching import Batch, to_device
from kbit_core.errors import ConfigError, TrainingDivergedError
from kbit_core.stream.ledger import IndexRuns, lag_grows, percentiles
from kbit_core.stream.source import StreamSource
from kbit_core.train import checkpoint as ckpt
from kbit_core.train.distributed import DistEnv, all_gather, broadcast_from_main, gather_to_main, launcher_pid
from kbit_core.train.engine import Engine
from kbit_core.train.loop import SplitLoaders, Trainer

log = logging.getLogger(__name__)

STOP_REASONS = ("", "duration", "records", "stop file", "signal", "launcher exited", "idle")


def stop_file_path(cfg: KbitConfig) -> Path:
    """Where a stop request is dropped: ``stream.stop_file`` (relative to the workdir) or one per stream topic."""
    if cfg.stream.stop_file is not None:
        return cfg.run_dir / cfg.stream.stop_file
    return cfg.run_dir / "streams" / f"{cfg.stream.topic_for(cfg.dataset, cfg.produce)}.stop"


@dataclass
class StreamState:
    """Progress a checkpoint carries: steps, records, and per partition the next offset/index and trained runs."""

    step: int = 0
    records: int = 0
    skipped_batches: int = 0
    offsets: list[int] = field(default_factory=list)
    indices: list[int | None] = field(default_factory=list)
    trained: list[IndexRuns] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per report window
    evals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Window:
    """What this rank saw since the last report."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0
    freshness_s: list[float] = field(default_factory=list)


class StreamTrainer(Trainer):
    """Trains on ``loaders.train``, a :class:`StreamSource`; val/test are the held-out topic's halves."""

    def __init__(
        self,
        cfg: KbitConfig,
        env: DistEnv,
        engine: Engine,
        loaders: SplitLoaders,
        checkpointer: ckpt.Checkpointer | None,
    ) -> None:
        super().__init__(cfg, env, engine, loaders, checkpointer)
        if not isinstance(loaders.train, StreamSource):
            raise ConfigError("train.mode=continuous needs a StreamSource as the train loader")
        self.source: StreamSource = loaders.train
        self.stream = StreamState()
        self.resumed = False
        self._signal: int | None = None
        # Once the process that started this rank is gone (killed with the job, so that neither a stop file nor
        # torchrun's SIGTERM may come), this rank is an orphan that would train on for as long as the stream flows.
        self._launcher = launcher_pid()
        self._freshness: list[float] = []  # rank 0: every trained record's freshness in this run
        self._lag_totals: list[float] = []
        self.lag_warnings: list[str] = []

    # ---- checkpoints -------------------------------------------------------------------------------------

    # Trainer's save/resume, with the stream's progress and every partition's position as the data position.

    def _progress_step(self) -> int:
        return self.stream.step

    def _data_position(self) -> dict[str, Any]:
        return {"positions": [[p, s["offset"], s["index"], s["trained"]] for p, s in self.source.state().items()]}

    def _checkpoint_meta(self, ranks: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Every partition's position and each rank's RNG state (the positions merged into rank 0's state)."""
        if ranks is None:
            return {}
        self._merge_positions(ranks)
        return {ckpt.TRAIN_STATE: asdict(self.stream), ckpt.RANKS: [{"rng": rank["rng"]} for rank in ranks]}

    def _restore(self, path: Path, meta: dict[str, Any]) -> None:
        try:
            self.stream = StreamState(**meta[ckpt.TRAIN_STATE])
        except TypeError:
            raise ConfigError(f"{path} is not a continuous-training checkpoint (train.mode=batch wrote it)") from None
        ranks = meta[ckpt.RANKS]
        if len(ranks) == self.env.world_size:  # same world size: each rank continues its own random stream
            ckpt.set_rng_state(ranks[self.env.rank]["rng"], self.env.device)
        self.source.load_positions(self.stream.offsets, self.stream.indices, self.stream.trained)
        self.resumed = True

    def _resumed_note(self, path: Path, num_ranks: int) -> str:
        return (
            f"resumed from {path}: step {self.stream.step}, {self.stream.records} records trained, written by "
            f"{num_ranks} rank(s), now {self.env.world_size}"
        )

    def _gather_positions(self) -> None:
        """Collective: every rank's partition positions merged into rank 0's state (the result without a save)."""
        ranks = self._gather_ranks()
        if ranks is not None:
            self._merge_positions(ranks)

    def _merge_positions(self, ranks: list[dict[str, Any]]) -> None:
        st, partitions = self.stream, self.source.num_partitions
        st.offsets, st.indices, st.trained = [0] * partitions, [None] * partitions, [[] for _ in range(partitions)]
        for rank in ranks:
            for partition, offset, index, trained in rank["positions"]:
                st.offsets[partition], st.indices[partition], st.trained[partition] = offset, index, trained

    # ---- the loop ----------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until the ranks agree to stop, then evaluate on the test split and write the final checkpoint.

        SIGTERM/SIGINT stay caught until that checkpoint is written: a stop agreed for another reason is often
        followed by one (a cancelled driver drops the stop file as its launcher forwards the SIGTERM it got), which
        would otherwise end the rank between the stop and its checkpoint.
        """
        if not self.resumed:
            self.source.start_fresh()
        records_before = self.stream.records
        started = time.monotonic()
        with self._stop_signals():
            reason = self._train_until_stopped(started)
            seconds = time.monotonic() - started
            test = self._evaluate("test") if self.loaders.test is not None else None
            if self.cfg.checkpoint.dir:
                self.save()
            else:
                self._gather_positions()
            if self.checkpointer is not None:
                self.checkpointer.wait()
        return self._stream_result(reason, seconds, self.stream.records - records_before, test)

    def _train_until_stopped(self, started: float) -> str:
        """Step on what arrives until a stop is agreed; its reason."""
        stream, st = self.cfg.stream, self.stream
        per_rank = max(1, self.cfg.train.global_batch_size // self.env.world_size)
        stop_file = stop_file_path(self.cfg)
        last_step = started
        window, reason = _Window(), ""
        taken = behind = 0  # records this rank trained in this run; how many fewer than the rank with the most
        while not reason:
            available = self._catch_up(self.source.fill(per_rank, stream.fill_timeout_s), min(behind, per_rank))
            counts = all_gather([available, self._local_stop(started, last_step, stop_file), taken], self.env)
            reason = STOP_REASONS[max(code for _, code, _ in counts)]
            fewest = min(n for n, _, _ in counts)
            if reason or fewest == 0:
                continue  # a starved rank keeps everyone waiting; what the others hold stays buffered
            last_step = time.monotonic()
            self._step(self.source.take(available), window)
            taken += available
            behind = max(n + before for n, _, before in counts) - taken
            st.records += sum(n for n, _, _ in counts)
            if st.step % stream.report_every_steps == 0:
                self._report(window)
                window = _Window()
            if self.loaders.val is not None and st.step % stream.eval_every_steps == 0:
                st.evals.append({"step": st.step, **self._evaluate("val")})
            if (
                self.cfg.checkpoint.dir
                and self.cfg.checkpoint.every_steps
                and st.step % self.cfg.checkpoint.every_steps == 0
            ):
                self.save()
        if window.steps:
            self._report(window)
        return reason

    def _catch_up(self, filled: int, behind: int) -> int:
        """How many records to take: what ``fill`` gave, and when this rank trained ``behind`` fewer records than
        another (its steps took fewer while its partitions waited, e.g. for a new leader) that many more of what it
        holds. Otherwise the ranks' partitions run dry at different steps: at a stream's end the last records of the
        rank that is behind wait for records the others never get, since a starved rank keeps everyone waiting."""
        return min(filled + behind, self.source.buffered()) if filled else 0

    def _local_stop(self, started: float, last_step: float, stop_file: Path) -> int:
        stream, now = self.cfg.stream, time.monotonic()
        checks = (
            stream.stop_after_s is not None and now - started >= stream.stop_after_s,
            stream.stop_after_records is not None and self.stream.records >= stream.stop_after_records,
            stop_file.exists(),
            self._signal is not None,
            os.getppid() != self._launcher,
            now - last_step >= stream.idle_timeout_s,
        )
        return next((code for code, hit in enumerate(checks, start=1) if hit), 0)

    @contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT ask for a clean stop (agreed with the other ranks at the next step); once one is agreed, they
        are only noted."""

        def request(signum: int, _frame: Any) -> None:
            self._signal = signum

        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, request)
        except ValueError:  # not the main thread (an engine running the entry on a thread): no handlers
            pass
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _step(self, batch: Batch, window: _Window) -> None:
        x, y = to_device(batch.x, batch.y, self.env.device)
        stats = self.forward_backward(x, y, boundary=True)
        if not stats.finite:
            if self.cfg.train.nan_policy == "fail":
                raise TrainingDivergedError(
                    f"loss is NaN/inf at stream step {self.stream.step + 1} on "
                    f"{stats.nonfinite_ranks} rank(s); lower the learning rate, enable "
                    "grad_clip_norm, or set train.nan_policy=skip"
                )
            self.stream.skipped_batches += 1
            return
        self.engine.step()
        self.stream.step += 1
        now_ms = time.time() * 1000
        window.steps += 1
        window.loss_sum += stats.loss_sum
        window.correct += stats.correct
        window.count += stats.count
        window.freshness_s.extend(((now_ms - batch.produced_ms) / 1000).tolist())

    def _evaluate(self, split: str) -> dict[str, float]:
        # Always the held-out set's epoch 0: every evaluation sees the same records, read into memory once.
        return self.evaluate(getattr(self.loaders, split), 0)

    # ---- reporting ---------------------------------------------------------------------------------------

    def _report(self, window: _Window) -> None:
        """Collective: one history entry of lag, freshness and throughput over the window just ended."""
        lag = self.source.lag(int(time.time() * 1000))
        gathered = gather_to_main(
            {
                "fresh": window.freshness_s,
                "resets": self.source.resets,
                "skipped": self.source.skipped,
                "lag": [[p, behind, seconds] for p, (behind, seconds) in lag.items()],
            },
            self.env,
        )
        if gathered is None:
            return
        fresh = [f for rank in gathered for f in rank["fresh"]]
        self._freshness.extend(fresh)
        lags = sorted((p, behind, seconds) for rank in gathered for p, behind, seconds in rank["lag"])
        seconds = time.perf_counter() - window.started
        entry = {
            "step": self.stream.step,
            "records": self.stream.records,
            "wall_time": time.time(),
            "train_loss": window.loss_sum / window.count if window.count else float("nan"),
            "train_accuracy": window.correct / window.count if window.count else 0.0,
            "records_per_s": window.count / seconds if seconds > 0 else 0.0,
            **{f"freshness_{k}_s": v for k, v in percentiles(fresh).items()},
            "lag_records": sum(b for _, b, _ in lags),
            "lag_seconds": max((s for _, _, s in lags), default=0.0),
            **{f"lag_records_p{p}": b for p, b, _ in lags},
            **{f"lag_seconds_p{p}": s for p, _, s in lags},
            "resets": sum(rank["resets"] for rank in gathered),
            "skipped_records": sum(rank["skipped"] for rank in gathered),
        }
        self.stream.history.append(entry)
        self._lag_totals.append(entry["lag_records"])
        if lag_grows(self._lag_totals, self.cfg.stream.lag_growth_windows):
            warning = (
                f"lag grows without bound: {entry['lag_records']} records behind at step {entry['step']}, its "
                f"floor up over the last {3 * self.cfg.stream.lag_growth_windows} report windows; the trainer "
                "does not keep up with the producer"
            )
            log.warning("%s", warning)
            self.lag_warnings.append(warning)
        self.console.print(
            f"step {entry['step']}: {entry['records']} records, {entry['records_per_s']:.0f}/s, "
            f"lag {entry['lag_records']} records / {entry['lag_seconds']:.2f} s, freshness p50 "
            f"{_fmt(entry['freshness_p50_s'])} p99 {_fmt(entry['freshness_p99_s'])} s, "
            f"loss {entry['train_loss']:.4f}"
        )

    def _stream_result(
        self, reason: str, seconds: float, records: int, test: dict[str, float] | None
    ) -> dict[str, Any]:
        st = self.stream
        last = st.history[-1] if st.history else {}
        result = {
            "mode": "continuous",
            "engine": self.engine.name,
            "backend": self.env.backend,
            "world_size": self.env.world_size,
            "stop_reason": reason,
            "steps": st.step,
            "records": st.records,
            "records_this_run": records,
            "seconds": seconds,
            "records_per_s": records / seconds if seconds > 0 else 0.0,
            "freshness_s": percentiles(self._freshness),
            **{f"freshness_{q}_s": v for q, v in percentiles(self._freshness).items()},
            "lag_records": last.get("lag_records"),
            "lag_seconds": last.get("lag_seconds"),
            "lag_warnings": self.lag_warnings,
            "resets": last.get("resets", 0),
            "skipped_batches": st.skipped_batches,
            "skipped_records": last.get("skipped_records", 0),  # bad records left out (reader.bad_records=skip)
            "val_accuracy": [e["accuracy"] for e in st.evals],
            "test_loss": test["loss"] if test else None,
            "test_accuracy": test["accuracy"] if test else None,
            "checkpoint": self.last_checkpoint,
            "resumed": self.resumed,
            "offsets": st.offsets,
            "trained": st.trained,
            "history": st.history,
            "evals": st.evals,
        }
        if self.env.is_main:
            self.console.print(
                f"stopped ({reason}) at step {st.step}: {records} records in {seconds:.1f} s; "
                f"freshness {result['freshness_s']}; test accuracy {result['test_accuracy']}"
            )
        return broadcast_from_main(result)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
