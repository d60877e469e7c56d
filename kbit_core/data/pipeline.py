"""Run an iterator on a background thread behind a bounded queue, so producing items overlaps consuming them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

_END = object()


class _Failure(NamedTuple):
    exc: BaseException


def threaded(items: Iterator[T], maxsize: int, name: str) -> Iterator[T]:
    """Yield ``items``, produced on a thread named ``name`` at most ``maxsize`` ahead of the caller.

    An exception on the thread is re-raised here; closing this generator stops the thread (after the item it is
    producing) and closes ``items``.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as exc:  # handed to the consuming thread, which re-raises it
            put(_Failure(exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        worker.join()
