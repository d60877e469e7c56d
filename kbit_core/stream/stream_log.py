"""The live producer's append-only stream log (a live stream's manifest): JSON lines, a header naming the stream,
then one line per delivered segment (one partition's index run and the offsets it landed at).

``<workdir>/streams/<topic>.jsonl``; each line is written and flushed only after the broker acknowledged the
segment, so the file never claims a record that was not delivered. A producer restart continues the sequence
from it, and a broker that lost the topic is refilled from it record for record.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kbit_core.errors import ManifestMismatchError, TopicError
from kbit_core.stream.ledger import IndexRuns, add_run

STREAM_DIR = "streams"


def stream_log_path(workdir: Path, topic: str) -> Path:
    return Path(workdir).resolve() / STREAM_DIR / f"{topic}.jsonl"


@dataclass(frozen=True)
class Segment:
    """Indices ``first_index, first_index + P, ..., last_index`` at offsets ``first_offset..last_offset`` of
    ``partition`` (inclusive both ends, as the batch manifests), produced at ``produced_ms``."""

    partition: int
    first_index: int
    last_index: int
    first_offset: int
    last_offset: int
    produced_ms: int

    @property
    def records(self) -> int:
        return self.last_offset - self.first_offset + 1


class StreamLog:
    """One stream's manifest: its header (topic, partitions, variant, dataset) and segments in delivery order."""

    def __init__(self, path: Path, header: dict[str, Any], segments: list[Segment]) -> None:
        self.path, self.header, self.segments = path, header, segments

    @classmethod
    def open(cls, path: Path, header: dict[str, Any]) -> StreamLog:
        """The log at ``path`` (created with ``header`` when absent); a different header is an error."""
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x") as out:
                out.write(json.dumps({"header": header}) + "\n")
            return cls(path, header, [])
        log = cls.load(path)
        diffs = [
            f"{key}: {log.header.get(key)!r} != {value!r}"
            for key, value in header.items()
            if log.header.get(key) != value
        ]
        if diffs:
            raise ManifestMismatchError(
                f"the stream manifest {path} was written for another stream "
                "(manifest != request):\n  " + "\n  ".join(diffs)
            )
        return log

    @classmethod
    def load(cls, path: Path) -> StreamLog:
        lines = path.read_text().splitlines()
        if not lines:
            raise TopicError(f"stream manifest {path} is empty (no header line)")
        header = json.loads(lines[0])["header"]
        segments = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                segments.append(Segment(**json.loads(line)))
            except (ValueError, TypeError) as exc:
                # Only the last line can be torn (a crash mid-write); anything earlier is damage.
                if number == len(lines):
                    break
                raise TopicError(f"stream manifest {path} line {number} is not a segment: {exc}") from None
        log = cls(path, header, segments)
        log.check()
        return log

    @property
    def partitions(self) -> int:
        return int(self.header["partitions"])

    def append(self, segments: list[Segment]) -> None:
        """Add delivered segments durably (flushed and fsynced before returning)."""
        with self.path.open("a") as out:
            out.writelines(json.dumps(asdict(s)) + "\n" for s in segments)
            out.flush()
            os.fsync(out.fileno())
        self.segments.extend(segments)

    def next_index(self) -> int:
        return max((s.last_index for s in self.segments), default=-1) + 1

    def end_offsets(self) -> dict[int, int]:
        """Per partition, one past the last offset produced (0 for a partition never written)."""
        ends = dict.fromkeys(range(self.partitions), 0)
        for s in self.segments:
            ends[s.partition] = max(ends[s.partition], s.last_offset + 1)
        return ends

    def runs(self) -> dict[int, IndexRuns]:
        """Per partition, the produced index runs (stride = partitions), for the audit."""
        out: dict[int, IndexRuns] = {p: [] for p in range(self.partitions)}
        for s in self.segments:
            add_run(out[s.partition], s.first_index, s.last_index, self.partitions)
        return out

    def check(self) -> None:
        """Every partition's offsets and indices continue without gaps from 0 (what a refill relies on)."""
        expected_offset = dict.fromkeys(range(self.partitions), 0)
        expected_index = {p: p for p in range(self.partitions)}
        for s in self.segments:
            p = s.partition
            count = (s.last_index - s.first_index) // self.partitions + 1
            if (s.first_offset, s.first_index) != (expected_offset[p], expected_index[p]) or count != s.records:
                raise TopicError(
                    f"stream manifest {self.path}: partition {p} segment {asdict(s)} does not continue "
                    f"at offset {expected_offset[p]} / index {expected_index[p]}"
                )
            expected_offset[p], expected_index[p] = s.last_offset + 1, s.last_index + self.partitions
