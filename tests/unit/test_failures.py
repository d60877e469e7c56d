"""Reading torchrun's and Spark's own failure records: which rank died, where, and how."""

from __future__ import annotations

import sys

from kbit_core.launch.failures import ExecutorLoss, OutputTail, RankExit, executor_loss, rank_exits, rank_lines

# Two torchrun agents' summaries as a cluster-mode run relays them (trimmed from a real run): node1's agent saw
# its rank 0 torn down by SIGTERM, node2's agent saw rank 1 killed by SIGKILL first.
SUMMARIES = """\
[rank0]: Traceback (most recent call last):
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_12:45:34
  host      : node1
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22821)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22821
============================================================
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_12:45:35
  host      : node2
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_12:45:34
  host      : node2
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 22822)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 22822
============================================================
"""


def test_every_failed_rank_is_read_with_root_causes_first() -> None:
    exits = rank_exits(SUMMARIES)
    assert exits == [
        RankExit(rank=0, host="node1", exitcode=-15, pid=22821),
        RankExit(rank=1, host="node2", exitcode=-9, pid=22822),
    ]
    assert (
        exits[1].signal_name == "SIGKILL"
        and exits[1].describe() == "rank 1 on host node2 (pid 22822) killed by SIGKILL"
    )
    assert RankExit(rank=2, host="h", exitcode=3, pid=7).describe() == "rank 2 on host h (pid 7) exited with code 3"


def test_output_without_a_summary_names_no_rank() -> None:
    assert rank_exits("Traceback (most recent call last):\nValueError: bad label\n") == []


def test_a_ranks_own_lines_are_picked_by_torchruns_prefix() -> None:
    assert rank_lines(SUMMARIES, 0, 1) == [
        "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
        "transport/tcp/pair.cc:553] Connection closed by peer"
    ]
    assert rank_lines(SUMMARIES, 1, 5) == []


def test_an_executor_loss_names_executor_host_and_rank() -> None:
    message = (
        "Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. Most recent "
        "failure reason: Stage failed because barrier task ResultTask(0, 1) finished unsuccessfully.\n"
        "ExecutorLostFailure (executor 1 exited caused by one of the running tasks) Reason: Command exited "
        "with code 137\n13:08:51 ERROR TaskSchedulerImpl: Lost executor 1 on 10.213.7.12: Command exited"
    )
    assert executor_loss(message) == ExecutorLoss(executor="1", host="10.213.7.12", rank=1)
    assert executor_loss(
        "Lost task 0.0 in stage 0.0 (TID 0) (10.213.7.11 executor 0): ExecutorLostFailure "
        "(executor 0 exited unrelated to the running tasks)"
    ) == ExecutorLoss(executor="0", host="10.213.7.11", rank=None)
    assert executor_loss("TorchDistributor failed during training.") is None


def test_the_output_tail_keeps_what_was_written_and_still_shows_it(capsys) -> None:
    tail = OutputTail(max_lines=2)
    with tail.capturing():
        print("first")
        print("second")
        print("third", file=sys.stderr)
    assert tail.text() == "second\nthird\n"
    shown = capsys.readouterr()
    assert shown.out == "first\nsecond\n" and shown.err == "third\n"
