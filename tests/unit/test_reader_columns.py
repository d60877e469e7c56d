"""The reader's whole-poll path: a poll recognised as exactly the next offsets of the range's partition is taken as
the per-record path takes it (same records, same carry, no gaps), and anything else is left to the per-record path."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kbit_core.config import KafkaConfig, ReaderConfig
from kbit_core.data.reader import RangeReader, continues_at
from kbit_core.kafka.consumers import RawRecord
from kbit_core.sharding import OffsetRange

records = st.lists(
    st.builds(RawRecord, st.integers(0, 1), st.integers(0, 40), st.one_of(st.none(), st.binary(max_size=3))),
    max_size=30,
)


def per_record(rng: OffsetRange, batch: list[RawRecord], start: int) -> tuple[list[RawRecord], list[RawRecord], int]:
    reader = RangeReader(KafkaConfig(), ReaderConfig(), "topic", codec=None)
    taken: list[RawRecord] = []
    next_offset = reader._take_each(rng, batch, start, taken)
    return taken, reader._carry, next_offset


@settings(max_examples=300, deadline=None)
@given(records, st.integers(0, 1), st.integers(0, 40))
def test_continues_at_is_exactly_the_next_offsets_of_one_partition(batch, partition, offset):
    expected = all(r.partition == partition and r.offset == offset + i for i, r in enumerate(batch))
    assert continues_at(batch, partition, offset) == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1), st.integers(0, 20), st.integers(0, 25), st.integers(1, 30), st.integers(0, 30))
def test_a_contiguous_poll_is_taken_as_the_per_record_path_takes_it(partition, start, length, count, skip):
    rng = OffsetRange(partition, start, start + length)
    first = start + min(skip, length)  # where the range stands after earlier polls
    batch = [RawRecord(partition, first + i, bytes([i % 256])) for i in range(count)]
    assert continues_at(batch, partition, first)
    take = min(count, rng.stop - first)
    taken, carry, next_offset = per_record(rng, batch, first)
    assert (taken, carry, next_offset) == (batch[:take], batch[take:], first + take)


@settings(max_examples=200, deadline=None)
@given(records, st.integers(0, 1), st.integers(0, 40))
def test_a_poll_with_gaps_other_partitions_or_redeliveries_is_not_taken_whole(batch, partition, offset):
    if continues_at(batch, partition, offset):
        return
    # whatever the per-record path does with it, it is not "every record, in order, from offset on"
    rng = OffsetRange(partition, offset, offset + 100)
    taken, _, next_offset = per_record(rng, batch, offset)
    assert not batch or taken != batch or next_offset != offset + len(batch)
