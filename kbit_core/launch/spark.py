"""One SparkSession per process, built from the typed LaunchConfig: loopback-bound, quiet, GPU-aware."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kbit_core.config import KbitConfig, LaunchConfig, local_slots
from kbit_core.errors import DistributedError
from kbit_core.testbed import require_bed_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

# Spark logs through log4j2 before Python can call setLogLevel, so its start-up WARNs are silenced
# by handing the JVM this file (console at error level) through extraJavaOptions.
LOG4J2_PROPERTIES = """\
rootLogger.level = error
rootLogger.appenderRef.console.ref = console
# PySpark's gateway counts as a shell; when its logger's level equals the root's, Spark skips its
# "Setting default log level" banner.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
"""

# pip's pyspark ships no GPU discovery script; this prints the resource JSON Spark expects from nvidia-smi.
GPU_DISCOVERY_SCRIPT = """\
#!/usr/bin/env bash
echo "{\\"name\\": \\"gpu\\", \\"addresses\\": [$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null \
| sed 's/.*/"&"/' | paste -sd, -)]}"
"""

_lock = threading.Lock()
_session: SparkSession | None = None  # the one kbit built; also found from threads where it is not "active"
_session_dir: Path | None = None


def spark_dir(run_dir: Path) -> Path:
    """Where the session keeps its log4j2 file, scratch space and the executors' TMPDIR."""
    return Path(run_dir) / "spark"


def worker_tmp_dir() -> Path | None:
    """TMPDIR the Spark Python workers (and their torchrun children) got; None before a session exists."""
    return _session_dir / "worker-tmp" if _session_dir else None


def _prepare_process_env(launch: LaunchConfig) -> None:
    """Variables the JVM and every Python worker inherit: they must be set before the JVM starts."""
    os.environ["SPARK_LOCAL_IP"] = launch.driver_host
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    if not launch.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _discovery_script(launch: LaunchConfig, sdir: Path) -> Path:
    if launch.gpu_discovery_script is not None:
        script = Path(launch.gpu_discovery_script).resolve()
        if not script.is_file():
            raise DistributedError(f"launch.gpu_discovery_script does not exist: {script}")
        return script
    script = sdir / "gpu_discovery.sh"
    script.write_text(GPU_DISCOVERY_SCRIPT)
    script.chmod(0o755)
    return script


def spark_conf(launch: LaunchConfig, run_dir: Path) -> dict[str, str]:
    """Every Spark setting kbit applies for ``launch``; ``launch.spark_conf`` wins over all of them."""
    sdir = spark_dir(run_dir)
    log4j = sdir / "log4j2.properties"
    java_opts = f"-Dlog4j2.configurationFile=file:{log4j}"
    conf: dict[str, str] = {
        "spark.app.name": "kbit",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": launch.driver_host,
        "spark.driver.bindAddress": launch.driver_bind_address,
        "spark.driver.extraJavaOptions": java_opts,
        "spark.executor.extraJavaOptions": java_opts,
        "spark.local.dir": str(sdir / "local"),
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
        # Fail a barrier job that cannot get its slots in seconds instead of retrying 40 × 15 s.
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    }
    if launch.driver_port is not None:
        conf["spark.driver.port"] = str(launch.driver_port)
    if launch.block_manager_port is not None:
        conf["spark.driver.blockManager.port"] = str(launch.block_manager_port)
    if local_slots(launch.master) is not None or launch.master.startswith("local-cluster"):
        # Executors share this host: their temp files land where kbit cleans up. A cluster's executors keep
        # their own TMPDIR, since this path need not exist on their hosts.
        conf["spark.executorEnv.TMPDIR"] = str(sdir / "worker-tmp")
    if not launch.use_gpu:
        conf["spark.executorEnv.DS_ACCELERATOR"] = "cpu"
    if launch.executor_instances is not None:
        conf["spark.executor.instances"] = str(launch.executor_instances)
    if launch.executor_cores is not None:
        conf["spark.executor.cores"] = str(launch.executor_cores)
    if launch.executor_memory is not None:
        conf["spark.executor.memory"] = launch.executor_memory
    if launch.use_gpu:
        script = str(_discovery_script(launch, sdir))
        if launch.local_mode:
            conf["spark.driver.resource.gpu.amount"] = str(launch.executor_gpu_amount or launch.num_processes)
            conf["spark.driver.resource.gpu.discoveryScript"] = script
        else:
            executor_gpus = str(launch.executor_gpu_amount or 1)
            conf["spark.executor.resource.gpu.amount"] = executor_gpus
            conf["spark.executor.resource.gpu.discoveryScript"] = script
            conf["spark.task.resource.gpu.amount"] = _format_amount(launch.task_gpu_amount or 1)
            if launch.master.startswith("local-cluster"):
                conf["spark.worker.resource.gpu.amount"] = executor_gpus
                conf["spark.worker.resource.gpu.discoveryScript"] = script
    for key, value in launch.spark_conf.items():
        if key.endswith("extraJavaOptions") and key in conf:
            value = f"{conf[key]} {value}"
        conf[key] = value
    return conf


def _format_amount(amount: float) -> str:
    return str(int(amount)) if float(amount).is_integer() else str(amount)


def get_spark(cfg: KbitConfig) -> SparkSession:
    """The process's SparkSession: an active one is reused, otherwise one is built from ``cfg.launch``."""
    global _session, _session_dir
    with _lock:
        # pyspark takes seconds to import: loaded only where Spark is used
        from pyspark.sql import SparkSession

        active = (
            _session
            if _session is not None and _session.sparkContext._jsc is not None
            else SparkSession.getActiveSession()
        )
        if active is not None:
            _warn_if_different(active, cfg.launch)
            return active
        launch = cfg.launch
        require_bed_for([launch.master, launch.driver_host, launch.driver_bind_address])
        sdir = spark_dir(cfg.run_dir)
        for sub in ("local", "worker-tmp"):
            (sdir / sub).mkdir(parents=True, exist_ok=True)
        (sdir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
        _prepare_process_env(launch)
        builder = SparkSession.builder.master(launch.master)
        for key, value in spark_conf(launch, cfg.run_dir).items():
            builder = builder.config(key, value)
        log.info(
            "starting Spark (%s) for %d %s process(es)",
            launch.master,
            launch.num_processes,
            "GPU" if launch.use_gpu else "CPU",
        )
        try:
            session = builder.getOrCreate()
        except Exception as exc:
            raise DistributedError(f"Spark could not start with master {launch.master!r}: {exc}") from exc
        session.sparkContext.setLogLevel("ERROR")
        _session, _session_dir = session, sdir
        atexit.register(stop_spark)
        return session


def _warn_if_different(session: SparkSession, launch: LaunchConfig) -> None:
    master = session.sparkContext.master
    if master != launch.master:
        log.warning(
            "reusing the running SparkSession on %s; launch.master=%s applies to a new process only",
            master,
            launch.master,
        )


def check_barrier_slots(session: SparkSession, launch: LaunchConfig) -> None:
    """Refuse a cluster-mode launch that a local[N] session cannot give num_processes barrier slots."""
    if launch.local_mode:
        return
    slots = local_slots(session.sparkContext.master)
    if slots is not None and slots < launch.num_processes:
        raise DistributedError(
            f"launch.local_mode=false needs {launch.num_processes} concurrent barrier tasks but the running "
            f"SparkSession ({session.sparkContext.master}) has {slots} slot(s); use local[{launch.num_processes}] "
            f"or more, a cluster master, or launch.local_mode=true"
        )


def wait_for_executors(session: SparkSession, launch: LaunchConfig, timeout_s: float = 120.0) -> None:
    """On a cluster master, wait until executors offer ``num_processes`` task slots (barrier jobs need them all
    at once: right after a start, or after an executor was lost and its worker is launching a new one)."""
    if launch.local_mode or local_slots(launch.master) is not None or launch.master.startswith("local"):
        return
    context = session.sparkContext._jsc.sc()
    profile = context.resourceProfileManager().defaultResourceProfile()
    deadline = time.monotonic() + timeout_s
    while True:
        # The number Spark's own barrier check compares with: free task slots of the registered executors.
        slots = int(context.maxNumConcurrentTasks(profile))
        if slots >= launch.num_processes:
            return
        if time.monotonic() > deadline:
            raise DistributedError(
                f"{launch.master} offers {slots} task slot(s) after {timeout_s:.0f} s but launch.num_processes="
                f"{launch.num_processes} barrier tasks need one each; check the workers (kbit cluster status)"
            )
        time.sleep(0.5)


def clean_worker_tmp() -> None:
    """Remove what torchrun agents and TorchDistributor left in the workers' TMPDIR (torchelastic_*, tmp*)."""
    tmp = worker_tmp_dir()
    if tmp is None or not tmp.is_dir():
        return
    for entry in tmp.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def stop_spark() -> None:
    """Stop the process's SparkSession (and its JVM) if one runs; safe to call twice."""
    global _session, _session_dir
    with _lock:
        # pyspark takes seconds to import: loaded only where Spark is used
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        # without a gateway (never started, or stopped before) pyspark cannot even ask for the active session
        session = _session or (SparkSession.getActiveSession() if SparkContext._jvm is not None else None)
        if session is not None and _jvm_exited():  # not asked to stop: py4j would log the dead link as an ERROR
            _forget_dead_session()
        elif session is not None:
            try:
                session.stop()
            except ConnectionError:  # the JVM went while stopping
                _forget_dead_session()
        _shutdown_jvm()
        if _session_dir is not None:
            shutil.rmtree(_session_dir / "worker-tmp", ignore_errors=True)
            shutil.rmtree(_session_dir / "local", ignore_errors=True)
        _session, _session_dir = None, None


def _forget_dead_session() -> None:
    """Drop pyspark's references to a session whose JVM has exited (e.g. killed with a cancelled run's process
    group), so a later session starts afresh."""
    # pyspark takes seconds to import: loaded only where Spark is used
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    log.info("Spark's JVM had already exited; nothing to stop")
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = SparkSession._activeSession = None


def _jvm_exited() -> bool:
    """Whether this process started Spark's JVM and it has exited since."""
    # pyspark takes seconds to import: loaded only where Spark is used
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    return proc is not None and proc.poll() is not None


def _shutdown_jvm() -> None:
    """End the py4j gateway JVM now rather than at interpreter exit, so no JVM outlives its session."""
    # pyspark takes seconds to import: loaded only where Spark is used
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.poll() is not None:
        # the JVM is gone: shutdown() would send it a command over a pooled connection, and py4j logs the reset as an
        # ERROR with its traceback; closing our end is all that is left to do
        gateway.close()
    else:
        gateway.shutdown()
    if proc is not None:
        proc.stdin.close()  # the gateway JVM exits when its stdin pipe closes
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    SparkContext._gateway = None
    SparkContext._jvm = None
