"""Spark's JVM killed under the driver (as a cancelled flow run's process-group kill does): stopping Spark
afterwards, explicitly and again at exit, is quiet and succeeds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark

SCRIPT = """
import os, signal, sys
from pyspark import SparkContext
from kbit_core.config import KbitConfig
from kbit_core.launch.spark import get_spark, stop_spark

get_spark(KbitConfig.from_dict({"workdir": sys.argv[1], "launch": {"master": "local[1]"}}))
jvm = SparkContext._gateway.proc
os.kill(jvm.pid, signal.SIGKILL)
jvm.wait()
stop_spark()
print("stopped")
"""  # stop_spark runs once more at exit (atexit)


def test_stopping_spark_after_its_jvm_was_killed_is_clean(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "kbit")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "stopped"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
