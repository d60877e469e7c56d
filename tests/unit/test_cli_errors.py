"""The CLI's error printer: plain text whatever the message holds, a traceback only with --debug, and SIGTERM
turned into the same KeyboardInterrupt as Ctrl-C."""

from __future__ import annotations

import os
import signal

import pytest
import typer

from kbit_core.cli import common
from kbit_core.errors import TopicError


def raise_(exc: BaseException) -> None:
    raise exc


@pytest.fixture(autouse=True)
def no_debug():
    common.set_debug(False)
    yield
    common.set_debug(False)


def test_markup_in_a_message_is_printed_as_text(capsys):
    gloo = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"
    with pytest.raises(typer.Exit) as exit_:
        common.run_guarded(raise_, TopicError(gloo))
    assert exit_.value.exit_code == 1
    assert capsys.readouterr().err == f"error: {gloo}\n"


def test_an_unexpected_error_names_its_type_and_points_to_debug(capsys):
    with pytest.raises(typer.Exit):
        common.run_guarded(raise_, ValueError("[bold]not markup[/bold]"))
    assert capsys.readouterr().err == (
        "error: ValueError: [bold]not markup[/bold]\n(run with --debug for the traceback)\n"
    )


def test_debug_prints_the_traceback_first(capsys):
    common.set_debug(True)
    with pytest.raises(typer.Exit):
        common.run_guarded(raise_, ValueError("boom"))
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith(
        "ValueError: boom\nerror: ValueError: boom\n"
    )


def test_an_interrupt_exits_130_with_how_to_resume(capsys):
    with pytest.raises(typer.Exit) as exit_:
        common.run_guarded(raise_, KeyboardInterrupt(), on_interrupt=common.TRAINING_STOPPED)
    assert exit_.value.exit_code == common.INTERRUPTED_EXIT == 130
    assert "rerun with --set checkpoint.resume=latest to continue" in capsys.readouterr().err


def test_an_interrupt_says_what_the_command_stopped_never_the_training_advice_elsewhere(capsys):
    """Issue 21 defect 6: produce and bench printed the training advice (workers, checkpoint.resume)."""
    for advice in (common.STOPPED, common.PRODUCE_STOPPED, common.BENCH_STOPPED):
        with pytest.raises(typer.Exit):
            common.run_guarded(raise_, KeyboardInterrupt(), on_interrupt=advice)
        assert capsys.readouterr().err == f"interrupted: {advice}\n"
        assert "checkpoint" not in advice


def test_sigterm_raises_keyboard_interrupt_through_the_sigint_handler():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        common.terminate_like_interrupt()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next bytecode
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_still_interrupts_when_the_sigint_handler_only_takes_note():
    noted: list[int] = []
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))  # as some libraries install
        common.terminate_like_interrupt()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        assert noted == [signal.SIGINT]  # the SIGINT handler in force still ran first (Spark cancels its jobs there)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
