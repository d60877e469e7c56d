"""DecodePool: worker processes decode a block's runs and the result is what ``codec.decode`` returns, bit for bit;
a corrupt value, a deferral and a dead worker each end as they would without the pool."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import orjson
import pytest

from kbit_core.config import KbitConfig
from kbit_core.data import decode_pool
from kbit_core.data.decode_pool import MIN_RUN_VALUES, DecodePool
from kbit_core.data.reader import RangeReader
from kbit_core.errors import ConfigError, CorruptRecordError
from kbit_core.formats import Codec, get_codec
from kbit_core.kafka.consumers import RawRecord

SHAPE = (1, 6, 5)
N = 4 * MIN_RUN_VALUES + 7  # runs of unequal length


def _block(codec: Codec, n: int = N) -> list[bytes]:
    rng = np.random.default_rng(n)
    images = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    return codec.encode(np.arange(1000, 1000 + n), images, rng.integers(0, 10, n))


def _equal(a, b) -> bool:
    return all(
        np.array_equal(getattr(a, k), getattr(b, k)) and getattr(a, k).dtype == getattr(b, k).dtype
        for k in ("indices", "labels", "pixels")
    )


@pytest.mark.parametrize(
    "format,layout,decoder",
    [("json", "list", "fast"), ("avro", "list", "fast"), ("bson", "bytes", "stock"), ("protobuf", "list", "fast")],
)
def test_the_pool_decodes_bit_for_bit_what_the_codec_decodes(format: str, layout: str, decoder: str):
    codec = get_codec(format, layout, SHAPE, num_classes=10, decoder=decoder)
    values = _block(codec)
    with DecodePool(codec, 2) as pool:
        # small, then large (the shared buffers grow), then small again (they are reused)
        for block in (values[: N // 2], values, values[: N // 2]):
            assert _equal(pool.decode(block), codec.decode(block))
        assert len(pool._workers) == 2 and all(w.process.is_alive() for w in pool._workers)
        workers = [w.process for w in pool._workers]
    assert not any(p.is_alive() for p in workers)  # close ends them
    assert _equal(pool.decode(values), codec.decode(values)) and pool._workers == []  # after close: the thread


def test_a_small_block_is_decoded_on_the_calling_thread():
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec, 2 * MIN_RUN_VALUES - 1)
    with DecodePool(codec, 3) as pool:
        assert _equal(pool.decode(values), codec.decode(values)) and pool._workers == []
        assert len(pool.decode([])) == 0


def test_a_corrupt_value_in_a_workers_run_raises_the_codecs_own_error():
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    values[N - 3] = values[N - 3][:-9]  # truncated, in the last worker's run
    with pytest.raises(CorruptRecordError) as expected:
        codec.decode(values)
    with DecodePool(codec, 2) as pool:
        with pytest.raises(CorruptRecordError) as raised:
            pool.decode(values)
        assert len(pool._workers) == 2  # the workers decoded, and stay for the next block
    assert str(raised.value) == str(expected.value) and f"value {N - 3} of {N}" in str(raised.value)


def test_a_block_that_fails_before_its_answers_are_read_leaves_no_worker_behind(monkeypatch: pytest.MonkeyPatch):
    # A run sent to one worker, then an error before its answer is read: that answer must not become the next
    # block's (one block behind, for the life of the pool).
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    with DecodePool(codec, 2) as pool:
        pool.decode(values)
        send, sent = decode_pool._Worker.send, []

        def second_send_fails(worker, run):
            sent.append(len(run))
            if len(sent) == 2:
                raise MemoryError("no room for the second run")
            send(worker, run)

        monkeypatch.setattr(decode_pool._Worker, "send", second_send_fails)
        with pytest.raises(MemoryError):
            pool.decode(values)
        monkeypatch.setattr(decode_pool._Worker, "send", send)
        assert pool._workers == []
        other = values[::-1]
        assert _equal(pool.decode(other), codec.decode(other)) and len(pool._workers) == 2
        # a value that is not bytes (a tombstone) gets the codec's own error, and the workers stay in step
        with pytest.raises(CorruptRecordError) as raised:
            pool.decode([*values[:-1], None])
        assert f"cannot decode value {N - 1} of {N} (null)" in str(raised.value)
        assert _equal(pool.decode(values), codec.decode(values))


def test_workers_that_cannot_start_leave_the_block_to_the_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    init, started = decode_pool._Worker.__init__, []

    def second_fails(worker, *args):
        if started:
            raise OSError(24, "Too many open files")
        init(worker, *args)
        started.append(worker.process)

    monkeypatch.setattr(decode_pool._Worker, "__init__", second_fails)
    with DecodePool(codec, 2) as pool, caplog.at_level(logging.WARNING, logger=decode_pool.__name__):
        assert _equal(pool.decode(values), codec.decode(values))
        assert "a decode worker process did not start: OSError(24, 'Too many open files')" in caplog.text
        assert pool._workers == [] and not started[0].is_alive()  # the one that started was stopped


def test_a_workers_deferrals_are_counted_on_the_codec():
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    values[-1] = orjson.dumps(orjson.loads(values[-1]), option=orjson.OPT_INDENT_2)  # the stock parser's to read
    with DecodePool(codec, 1) as pool:
        assert _equal(pool.decode(values), get_codec("json", "list", SHAPE, decoder="stock").decode(values))
    assert codec.deferred_batches == 1


def test_a_dead_worker_is_logged_its_block_still_decoded_and_the_workers_started_again(
    caplog: pytest.LogCaptureFixture,
):
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    expected = codec.decode(values)
    with DecodePool(codec, 1) as pool, caplog.at_level(logging.WARNING, logger=decode_pool.__name__):
        for _death in range(1, decode_pool.MAX_DEATHS + 1):
            pool.decode(values)
            (worker,) = pool._workers
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.join()
            assert _equal(pool.decode(values), expected)
            message = caplog.records[-1].getMessage()
            assert f"decode worker process {worker.process.pid} died (exit code -9)" in message
            assert pool._workers == []
        assert "from now on without workers" in message and "starting the workers again" in caplog.text
        assert _equal(pool.decode(values), expected) and pool._workers == []  # the calling thread decodes alone


@pytest.mark.parametrize("workers", ["process", "partitions"])
def test_decode_processes_need_loader_threads(workers):
    assert KbitConfig.from_dict({"reader": {"decode_processes": 2}}).reader.decode_processes == 2
    with pytest.raises(ConfigError, match="reader.decode_processes needs reader.workers: thread"):
        KbitConfig.from_dict({"reader": {"decode_processes": 1, "workers": workers}})


def test_a_range_readers_pool_names_a_corrupt_records_coordinates():
    cfg = KbitConfig.from_dict({"reader": {"decode_processes": 1}})
    codec = get_codec("json", "list", SHAPE, decoder="fast")
    values = _block(codec)
    values[N - 2] = b'{"data":[0.5'
    records = [RawRecord(1, 500 + i, v) for i, v in enumerate(values)]
    reader = RangeReader(cfg.kafka, cfg.reader, "the-topic", codec)
    try:
        batch = reader.decode(records[: N - 2])
        assert _equal(batch, codec.decode(values[: N - 2]))
        with pytest.raises(CorruptRecordError, match=rf"topic=the-topic, partition=1, offset={500 + N - 2}"):
            reader.decode(records)
        workers = [w.process for w in reader._decoder._workers]
    finally:
        reader.close()
    assert workers and not any(p.is_alive() for p in workers)
