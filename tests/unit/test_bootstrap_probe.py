"""Which bootstrap servers accept a connection: a server that drops connections is left out while others accept."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kbit_core.kafka.bootstrap import answering


@pytest.fixture
def open_server() -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_a_server_that_drops_connections_is_left_out_without_waiting_for_it(silent_server: str, open_server: str):
    started = time.monotonic()
    assert answering([silent_server, open_server], timeout_s=30) == [open_server]
    assert time.monotonic() - started < 10  # the open server's answer ended the wait, not the 30 s timeout


def test_nothing_to_choose_leaves_the_list_as_it_is(silent_server: str, open_server: str):
    assert answering([silent_server], timeout_s=30) == [silent_server]  # a single server is not even dialled
    both_silent = [silent_server, silent_server]
    assert answering(both_silent, timeout_s=0.5) == both_silent  # none accepts: the client reports it itself
    assert answering(["127.0.0.1:not-a-port", open_server], timeout_s=5) == [open_server]
