"""What a training run prints and reports besides its metrics: the shard plan, per-epoch lines, the final table,
and the data counts summed over ranks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from rich.table import Table

from kbit_core.data.loader import LoaderStats

# Counters of what a loader read, summed over ranks into the result: corrupt messages skipped, records repeated in
# their place, offsets missing inside planned ranges, transient client errors retried, records read but not yielded
# (the tail of a multi-record message past the rank's last whole batch).
READ_COUNTS = ("skipped_messages", "padded_records", "gaps", "retries", "left_out_records")
# What the shard plan leaves out or repeats every epoch, reported with a _per_epoch suffix.
PLAN_COUNTS = ("dropped_messages", "padded_messages", "dropped_tail_records")


class HasStats(Protocol):
    stats: LoaderStats


def plan_line(plan: Mapping[str, Mapping[str, int]]) -> str:
    """One line: per split, what one epoch's shard plan reads, drops and pads."""
    parts = [
        f"{name} {p['messages']} messages ({p['messages_per_rank']} per rank), {p['dropped_messages']} "
        f"dropped, {p['padded_messages']} padded, {p['dropped_tail_records']} tail records dropped"
        for name, p in plan.items()
    ]
    return "shard plan per epoch: " + "; ".join(parts)


def data_report(
    loaders: Mapping[str, HasStats], plan: Mapping[str, Mapping[str, int]], device: torch.device
) -> dict[str, dict[str, int]]:
    """Collective: per split, READ_COUNTS summed over ranks for this run's reads, and the plan's PLAN_COUNTS."""
    local = [
        [
            s.reader.skipped,
            s.padded_records,
            s.reader.gaps,
            s.reader.retries,  # READ_COUNTS' order
            s.left_out_records,
        ]
        for s in (loader.stats for loader in loaders.values())
    ]
    counts = torch.tensor(local, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(counts)
    report = {}
    for name, row in zip(loaders, counts.tolist(), strict=True):
        planned = plan.get(name, {})
        report[name] = {
            **dict(zip(READ_COUNTS, row, strict=True)),
            **{f"{key}_per_epoch": planned[key] for key in PLAN_COUNTS if key in planned},
        }
    return report


def epoch_line(m: Mapping[str, Any], epochs: int) -> str:
    """One epoch's train (and validation) loss, accuracy, throughput and data wait."""
    val = f"  val loss {m['val_loss']:.4f} acc {m['val_accuracy']:.4f}" if "val_loss" in m else ""
    return (
        f"epoch {m['epoch'] + 1}/{epochs}: train loss {m['train_loss']:.4f} "
        f"acc {m['train_accuracy']:.4f}{val}  {m['train_samples_per_s']:.0f} samples/s  "
        f"data wait {m['train_data_wait_fraction']:.0%}"
    )


def history_table(history: Iterable[Mapping[str, Any]], test: Mapping[str, float] | None) -> Table:
    """The run's epochs as a table, with the test loss and accuracy as its caption."""
    table = Table(title="training")
    for column in ("epoch", "train loss", "train acc", "val loss", "val acc", "samples/s", "data wait"):
        table.add_column(column, justify="right")
    for h in history:
        table.add_row(
            str(h["epoch"] + 1),
            f"{h['train_loss']:.4f}",
            f"{h['train_accuracy']:.4f}",
            f"{h['val_loss']:.4f}" if "val_loss" in h else "-",
            f"{h['val_accuracy']:.4f}" if "val_accuracy" in h else "-",
            f"{h['train_samples_per_s']:.0f}",
            f"{h['train_data_wait_fraction']:.0%}",
        )
    if test:
        table.caption = f"test loss {test['loss']:.4f}  test accuracy {test['accuracy']:.4f}"
    return table
