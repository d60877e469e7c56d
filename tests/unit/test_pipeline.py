"""threaded() and ChildProcess: items arrive in order, at most maxsize ahead; errors reach the consumer; closing
stops the thread or the child process."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kbit_core.data.pipeline import ChildProcess, threaded
from kbit_core.errors import KbitError
from tests.conftest import loader_workers


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


def logged_tensors(log: Path, count: int) -> Iterator[torch.Tensor]:
    """Runs in the child: each tensor is noted in ``log`` as it is made."""
    for i in range(count):
        with log.open("a") as f:
            f.write(f"{i}\n")
        yield torch.full((4, 3), float(i))


def failing(error: type[Exception], *args: object) -> Iterator[int]:
    yield 1
    raise error(*args)


class Unpicklable(Exception):
    def __init__(self, message: str, detail: object) -> None:  # pickling calls it with the message only
        super().__init__(message)


def test_a_child_process_hands_over_tensors_in_order_at_most_maxsize_ahead(tmp_path: Path) -> None:
    log = tmp_path / "made.txt"
    child = ChildProcess(functools.partial(logged_tensors, log), 2)
    try:
        assert [int(t[0, 0]) for t in child.run(20)] == list(range(20))
        (worker,) = loader_workers()
        log.unlink()
        items = child.run(100)
        assert torch.equal(next(items), torch.zeros(4, 3))
        time.sleep(1.0)
        # one handed over and two requested ahead; the child makes nothing unasked
        assert len(log.read_text().split()) <= 1 + 2 + 1
        items.close()
        assert [int(t[0, 0]) for t in child.run(3)] == [0, 1, 2], "a run after an abandoned one starts afresh"
        assert loader_workers() == [worker], "one child serves every run"
    finally:
        child.close()
    assert not loader_workers()


def test_a_child_process_raises_the_child_error_with_its_type_and_message() -> None:
    child = ChildProcess(functools.partial(failing, ValueError), 2)
    try:
        items = child.run("broken range")
        assert next(items) == 1
        with pytest.raises(ValueError) as err:
            next(items)
        assert str(err.value) == "broken range"
        assert any("raised in the worker process" in note for note in err.value.__notes__)
        again = child.run("next run")
        assert next(again) == 1, "the child outlives an error in one run"
        again.close()
    finally:
        child.close()
    unpicklable = ChildProcess(functools.partial(failing, Unpicklable, "lost detail"), 2)
    try:
        with pytest.raises(KbitError, match="Unpicklable: lost detail"):
            list(unpicklable.run(7))
    finally:
        unpicklable.close()
    assert not loader_workers()
