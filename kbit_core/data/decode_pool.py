"""DecodePool: decode each block of message values on worker processes beside the calling thread, for decoders that
hold the GIL (simdjson's JSON lists, the stock libraries), on hosts with cores to spare.

A block is cut into ``processes + 1`` runs of values: the calling thread decodes the first while each worker decodes
one of the others. Values travel to a worker, and its decoded rows back, through shared-memory buffers that live as
long as the pool (grown when a block needs more), so only lengths and the small columns are pickled. Anything that
goes wrong in a run (a corrupt value, a deferral the worker could not settle, a dead worker) has the whole block
decoded again on the calling thread, which raises exactly the error a plain ``codec.decode`` raises; a dead worker is
logged and the workers start again for the next block (after a second death the calling thread decodes alone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kbit_core.data.pipeline import child_context, picklable
from kbit_core.errors import KbitError
from kbit_core.formats.base import Codec, DecodedBatch

log = logging.getLogger(__name__)

# Below this many values per run the pickling and wake-ups cost more than the run's decode.
MIN_RUN_VALUES = 64
# Workers that die again after a restart point at the host (memory, limits), not at one block.
MAX_DEATHS = 2


class DecodePool:
    """``decode(values)`` as ``codec.decode(values)`` returns it, with ``processes`` worker processes sharing the
    work; safe to call from several threads (one block at a time). Workers start at the first block."""

    def __init__(self, codec: Codec, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"a decode pool needs at least one worker process, got {processes}")
        self.codec, self.processes = codec, processes
        self._workers: list[_Worker] = []
        self._deaths = 0  # worker sets that died; after MAX_DEATHS the calling thread decodes alone
        self._closed = False  # after close() the calling thread decodes alone
        self._lock = threading.Lock()

    def decode(self, values: Sequence[bytes]) -> DecodedBatch:
        runs = min(self.processes + 1, len(values) // MIN_RUN_VALUES)
        if runs < 2 or self._closed or self._deaths >= MAX_DEATHS or not all(isinstance(v, bytes) for v in values):
            return self.codec.decode(values)  # (a value that is not bytes gets the codec's own error)
        values = values if isinstance(values, list) else list(values)  # a fetched column: its runs go as bytes
        cuts = np.linspace(0, len(values), runs + 1).astype(int).tolist()
        with self._lock:
            try:
                workers = self._started()[: runs - 1]
                for worker, start, stop in zip(workers, cuts[1:], cuts[2:]):
                    worker.send(values[start:stop])
                parts = [self._decode_here(values[: cuts[1]])] + [worker.receive() for worker in workers]
                self._count_deferred(workers)
            except _WorkerDied as exc:
                self._deaths += 1
                then = "starting the workers again" if self._deaths < MAX_DEATHS else "from now on without workers"
                log.warning("%s; decoding this block on the calling thread, %s", exc, then)
                self._stop_workers()
                parts = [None]
            except BaseException:
                # a worker sent a run but not asked for its answer would answer the next block with this one's
                self._stop_workers()
                raise
            if all(part is not None for part in parts):  # joined here: the workers' pixels view their outboxes
                return DecodedBatch(
                    *(
                        np.concatenate([getattr(p, name) for p in parts])  # type: ignore[union-attr]
                        for name in ("indices", "labels", "pixels")
                    )
                )
        return self.codec.decode(values)

    def _started(self) -> list[_Worker]:
        """The workers, started now if they are not running; a start that fails counts as a death."""
        if not self._workers:
            try:
                for _ in range(self.processes):
                    self._workers.append(_Worker(self.codec))
            except Exception as exc:  # noqa: BLE001 - a host that cannot start processes decodes on the thread
                raise _WorkerDied(f"a decode worker process did not start: {exc!r}") from exc
        return self._workers

    def _decode_here(self, values: Sequence[bytes]) -> DecodedBatch | None:
        try:
            return self.codec.decode(values)
        except Exception:  # noqa: BLE001 - the block is decoded again, raising the codec's own error
            return None

    def _count_deferred(self, workers: list[_Worker]) -> None:
        """Add the workers' deferrals to the codec's count, so the pool reports what ``codec.decode`` would."""
        deferred = sum(worker.deferred for worker in workers)
        if deferred and hasattr(self.codec, "deferred_batches"):
            self.codec.deferred_batches += deferred
        for worker in workers:
            worker.deferred = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop_workers()

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WorkerDied(KbitError):
    pass


class _Worker:
    """The parent's end of one worker process: its pipe, and the shared buffer that carries values to it."""

    def __init__(self, codec: Codec) -> None:
        context = child_context()
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn, codec), name="kbit-decode", daemon=True)
        self.process.start()
        child_conn.close()
        self._inbox = torch.empty(0, dtype=torch.uint8)
        self._outbox: np.ndarray | None = None
        self.deferred = 0  # batches the worker's fast decoder handed to the stock library (FastPath.deferred_batches)

    def send(self, values: Sequence[bytes]) -> None:
        """Start decoding ``values`` (answered by :meth:`receive`)."""
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        total = int(lengths.sum())
        grown = None
        if total > len(self._inbox):
            self._inbox = grown = torch.empty(2 * total, dtype=torch.uint8).share_memory_()
        # value by value into the buffer: a joined copy first would be a fresh block-sized allocation every time
        inbox, at = memoryview(self._inbox.numpy()), 0
        for value in values:
            inbox[at : at + len(value)] = value
            at += len(value)
        self._call(lambda: self._conn.send((lengths, grown)))

    def receive(self) -> DecodedBatch | None:
        """The batch of the values last sent, or None when they did not decode; its pixels are a view of the outbox,
        valid until the next :meth:`send`."""
        answer = self._call(self._conn.recv)
        if isinstance(answer, BaseException):
            log.debug("decode worker %d could not decode its run: %r", self.process.pid, answer)
            return None
        indices, labels, dtype, shape, grown, deferred = answer
        if grown is not None:
            self._outbox = grown.numpy()
        assert self._outbox is not None
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.deferred += deferred
        return DecodedBatch(indices, labels, self._outbox[:size].view(dtype).reshape(shape))

    def _call(self, call: Any) -> Any:
        try:
            return call()
        except (EOFError, OSError) as exc:
            self.process.join(timeout=1)
            raise _WorkerDied(
                f"decode worker process {self.process.pid} died (exit code {self.process.exitcode}): {exc!r}"
            ) from None

    def stop(self) -> None:
        self._conn.close()  # the worker's recv ends with EOFError and it exits
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _serve(conn: Any, codec: Codec) -> None:
    """A worker's loop: decode the values each request names in the inbox, answer with the columns and the rows
    written to the outbox, until the parent closes the pipe."""
    inbox = memoryview(b"")
    outbox = torch.empty(0, dtype=torch.uint8)
    while True:
        try:
            lengths, grown = conn.recv()
        except EOFError:
            return
        if grown is not None:
            inbox = memoryview(grown.numpy())
        # one copy a value, from the buffer (one block-sized copy to slice would take fresh pages every time)
        ends = np.cumsum(lengths).tolist()
        values = [inbox[start:end].tobytes() for start, end in zip([0, *ends[:-1]], ends)]
        deferred = getattr(codec, "deferred_batches", 0)
        try:
            batch = codec.decode(values)
        except Exception as exc:  # noqa: BLE001 - the parent decodes the block again and raises the codec's error
            answer: Any = picklable(exc)
        else:
            rows = np.ascontiguousarray(batch.pixels).reshape(-1).view(np.uint8)
            new_outbox = None
            if len(rows) > len(outbox):
                outbox = new_outbox = torch.empty(2 * len(rows), dtype=torch.uint8).share_memory_()
            outbox.numpy()[: len(rows)] = rows
            answer = (
                batch.indices,
                batch.labels,
                batch.pixels.dtype.str,
                batch.pixels.shape,
                new_outbox,
                getattr(codec, "deferred_batches", 0) - deferred,
            )
        try:
            conn.send(answer)
        except OSError:  # the parent is gone
            return
