"""Run an iterator on a background thread or in a child process behind a bounded queue, so producing items overlaps
consuming them."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import queue
import select
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import psutil
import torch.multiprocessing
import torch.utils.data

from kbit_core.errors import KbitError

T = TypeVar("T")
R = TypeVar("R")

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


class ChildProcess(Generic[R, T]):
    """A child process that yields the items of ``source(request)`` for each :meth:`run` ``(request)``, at most
    ``maxsize`` ahead of the caller; ``source`` (picklable) lives in the child, and keeps what it opened (a Kafka
    consumer) from one run to the next. Tensors in the items cross in shared memory (``pin_memory``: page-locked
    here, by a thread).

    An exception in the child is re-raised here with its type and message (the child's traceback as a note). The
    child starts on the first run and ends on :meth:`close`, or when this process dies; its death is a one-line
    KbitError here naming ``name``.
    """

    def __init__(
        self,
        source: Callable[[R], Iterator[T]],
        maxsize: int,
        *,
        pin_memory: bool = False,
        name: str = "the loader's worker process",
    ) -> None:
        self.name = name
        context = child_context()
        self._requests: multiprocessing.Queue[R] = context.Queue()
        # torch's DataLoader with one persistent worker supplies the lifecycle: the bounded queue of requested
        # items, the parent's check that the worker is alive, and the shutdown.
        self._items = torch.utils.data.DataLoader(
            _ChildItems(source, self._requests),
            batch_size=None,
            num_workers=1,
            prefetch_factor=maxsize,
            collate_fn=_as_is,
            pin_memory=pin_memory,
            multiprocessing_context=context,
            persistent_workers=True,
            worker_init_fn=functools.partial(_exit_with, os.getpid()),
            # DataLoader seeds its worker from this generator on each new iterator; the default one is the rank's
            # global generator, whose draw would shift the rank's dropout and sampling away from thread mode's.
            generator=torch.Generator(),
        )

    def run(self, request: R) -> Iterator[T]:
        # The worker takes one request per iteration: iter() below starts (or resets) it after the put, and its
        # index queue is FIFO, so each iteration's first item is asked for before the next reset arrives.
        self._requests.put(request)
        items = iter(self._items)
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except (RuntimeError, EOFError, OSError) as exc:
                # DataLoader's own: the worker died, noticed by its status check (RuntimeError) or first while taking
                # an item's shared memory from the dead process (EOFError, ConnectionRefusedError)
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise KbitError(f"{self.name} failed: {detail}") from exc
            if isinstance(item, _Failure):
                raise item.exc
            yield item

    def close(self) -> None:
        iterator = self._items._iterator  # no public way to end a persistent worker now rather than at GC
        if iterator is not None:
            iterator._shutdown_workers()
            self._items._iterator = None
        self._requests.close()


def child_context() -> multiprocessing.context.BaseContext:
    """forkserver: the server is a fresh interpreter (never CUDA, no threads) that imports the loader once; each
    child forks from it in milliseconds. fork from a rank would copy its CUDA context and locks held by its other
    threads (NCCL, the Kafka clients'); spawn would import torch again for every split and epoch."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kbit_core.data.loader"])
    return context


def _exit_with(parent_pid: int, worker_id: int) -> None:
    """End this worker process when ``parent_pid`` ends. DataLoader's own check watches the worker's parent, here
    the forkserver, which lives on as long as any of its children holds its pipe: the worker itself."""
    threading.Thread(target=_wait_then_exit, args=(parent_pid,), name="kbit-parent-watch", daemon=True).start()


def _wait_then_exit(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3) or already gone: psutil polls
            psutil.Process(pid).wait()
        else:
            select.select([pidfd], [], [])
    os._exit(1)


class _ChildItems(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, source: Callable[[Any], Iterator[Any]], requests: multiprocessing.Queue[Any]) -> None:
        self.source, self.requests = source, requests

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.source(self.requests.get())
        except Exception as exc:  # handed to the parent, which re-raises it
            exc.add_note(f"raised in the worker process {os.getpid()}:\n{traceback.format_exc()}")
            yield _Failure(picklable(exc))


def picklable(exc: Exception) -> Exception:
    """``exc`` if it survives the trip to the parent; otherwise a KbitError with its type, message and notes (an
    item that does not pickle would be dropped by the queue's feeder thread, leaving the parent waiting)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        notes = "\n".join(getattr(exc, "__notes__", ()))
        return KbitError(f"{type(exc).__name__}: {exc}\n{notes}")


def _as_is(item: Any) -> Any:
    return item
