"""threaded(): items arrive in order, at most maxsize ahead; errors reach the consumer; closing stops the thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kbit_core.data.pipeline import threaded


def alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def test_items_arrive_in_order_and_the_thread_ends() -> None:
    assert list(threaded(iter(range(50)), 3, "kbit-test-order")) == list(range(50))
    assert not alive("kbit-test-order")


def test_the_producer_runs_at_most_maxsize_items_ahead() -> None:
    produced: list[int] = []

    def source() -> Iterator[int]:
        for i in range(100):
            produced.append(i)
            yield i

    items = threaded(source(), 2, "kbit-test-ahead")
    assert next(items) == 0
    time.sleep(0.3)
    # one item handed over, two queued, and one produced that waits for room
    assert len(produced) <= 1 + 2 + 1
    items.close()
    assert not alive("kbit-test-ahead")


def test_an_error_on_the_thread_is_raised_to_the_consumer() -> None:
    def source() -> Iterator[int]:
        yield 1
        raise ValueError("broken range")

    items = threaded(source(), 2, "kbit-test-error")
    assert next(items) == 1
    with pytest.raises(ValueError, match="broken range"):
        next(items)
    assert not alive("kbit-test-error")


def test_closing_early_closes_the_source() -> None:
    closed = threading.Event()

    def source() -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.set()

    items = threaded(source(), 4, "kbit-test-close")
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert closed.is_set() and not alive("kbit-test-close")
