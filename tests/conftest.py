"""Shared fixtures: a real embedded broker on a free loopback port, configs pointing at it, one Schema Registry
(Apicurio) and one SparkSession per test session, a TMPDIR to audit, the fault-injecting models (tests/integration/fault_models.py) for training, and one
Ray head per test session."""

from __future__ import annotations

import copy
import faulthandler
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

# Nothing a machine collected in its home (Ray's token, Prefect's profiles, caches) may make a test pass or fail:
# the suite runs with an empty home and XDG directories of its own, set before any test module is imported.
# (Test modules import this file again as tests.conftest: the variable keeps that second import on the same home.)
TEST_HOME = Path(os.environ.get("KBIT_TEST_HOME") or tempfile.mkdtemp(prefix="kbit-test-home-"))
os.environ["KBIT_TEST_HOME"] = str(TEST_HOME)
for _variable, _subdir in {
    "HOME": ".",
    "XDG_CONFIG_HOME": ".config",
    "XDG_CACHE_HOME": ".cache",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
}.items():
    os.environ[_variable] = str(TEST_HOME / _subdir)
# Nor may a user's running services: the suite's own stack record (`kbit stack up` writes where a profile finds its
# Ray head, kbit_core/stack_record.py) is empty unless a test starts a stack.
# Neither may the variables a user's shell holds after `eval "$(kbit stack env)"` or for their own Ray and kbit settings.
USER_SERVICE_VARIABLES = (
    "KBIT_SET",
    "PREFECT_API_URL",
    "PREFECT_HOME",
    "PREFECT_PROFILE",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "PREFECT_API_AUTH_STRING",
    "RAY_ADDRESS",
)
os.environ["KBIT_STATE_DIR"] = str(TEST_HOME / "kbit-state")
for _variable in USER_SERVICE_VARIABLES:
    os.environ.pop(_variable, None)

from kbit_core import ray_env  # noqa: E402  (after the home is set)
from kbit_core.brokers.broker import EmbeddedBroker
from kbit_core.config import KbitConfig, deep_merge
from kbit_core.service import Service


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (a run's workdir names its JVM, torchrun agents and ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def loader_workers(root: Any = None) -> list[Any]:
    """Live loader worker processes under ``root`` (a psutil.Process; default this process): its forkserver's
    children (``reader.workers: process``)."""
    import psutil

    found = []
    for proc in (root or psutil.Process()).children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "forkserver" in " ".join(proc.parent().cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


class Background(threading.Thread):
    """``target(*args, **kwargs)`` on a daemon thread, so one that hangs cannot keep pytest from exiting;
    ``result(timeout_s)`` returns what it returned, or raises what it raised or that it is still running."""

    def __init__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(daemon=True, name=f"background {getattr(target, '__qualname__', target)}")
        self._call = (target, args, kwargs)
        self._value: Any = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        target, args, kwargs = self._call
        try:
            self._value = target(*args, **kwargs)
        except BaseException as exc:  # handed to result(), in the test's own thread
            self._error = exc

    def result(self, timeout_s: float) -> Any:
        self.join(timeout_s)
        if self.is_alive():
            raise AssertionError(f"{self.name} is still running after {timeout_s:g}s")
        if self._error is not None:
            raise self._error
        return self._value


# A thread left running keeps the interpreter from exiting, and CI would wait for it until its own limit.
EXIT_WATCHDOG_S = 120
_exit_status = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_exit_status] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """After everything pytest does (session fixtures torn down, summary printed): end the process if it has not
    exited by itself within EXIT_WATCHDOG_S, printing every thread's stack, with the session's exit status or 1."""
    status = config.stash.get(_exit_status, 1)

    def exit_if_still_alive() -> None:
        sys.stderr.write(
            f"kbit tests: the interpreter has not exited {EXIT_WATCHDOG_S}s after the session; every thread's stack:\n"
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(status or 1)

    shutil.rmtree(TEST_HOME, ignore_errors=True)
    watchdog = threading.Timer(EXIT_WATCHDOG_S, exit_if_still_alive)
    watchdog.daemon = True
    watchdog.start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[str]:
    """host:port of a server that neither accepts nor refuses: a listener whose accept queue (backlog 0) one
    connection fills, so the kernel drops every later SYN, as a firewall that drops a cut-off broker's packets does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    filler.close()
    listener.close()


# The suite's broker: Apache Kafka (the default local broker), or Tansu with KBIT_TEST_BROKER=tansu.
BROKERS = ("apache-kafka", "tansu")


def suite_broker_kind() -> str:
    kind = os.environ.get("KBIT_TEST_BROKER") or "apache-kafka"
    if kind not in BROKERS:
        raise pytest.UsageError(f"KBIT_TEST_BROKER={kind!r}: expected one of {', '.join(BROKERS)}")
    return kind


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``both_brokers`` that use ``broker`` run once on each broker (ids ``apache-kafka``/``tansu``),
    except those marked ``own_broker`` (they start the broker they test)."""
    marked = metafunc.definition.get_closest_marker
    if "broker" in metafunc.fixturenames and marked("both_brokers") and not marked("own_broker"):
        metafunc.parametrize("broker", BROKERS, indirect=True, scope="session")


@pytest.fixture(scope="session")
def broker(request: pytest.FixtureRequest) -> Any:
    """The session's broker: Apache Kafka unless KBIT_TEST_BROKER=tansu; tests marked ``both_brokers`` get each of
    the two in turn. Both are session-wide (tests delete their topics)."""
    kind = getattr(request, "param", None) or suite_broker_kind()
    return request.getfixturevalue("apache_kafka" if kind == "apache-kafka" else "tansu")


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One Tansu broker for the whole session (memory only). Tests of Tansu-only behaviour use it directly."""
    b = EmbeddedBroker(tmp_path_factory.mktemp("tansu"), port=free_port())
    b.start()
    yield b
    b.stop()


# What a test needs of the machine and must never lack under CI: each variable, set to 1, makes its absence fail.
REQUIRE_APACHE_KAFKA = "KBIT_REQUIRE_APACHE_KAFKA"
REQUIRE_BED = "KBIT_REQUIRE_BED"  # the multi-host test bed and link shaping: root, namespaces, `ip`, `tc`, `nft`


def must_not_skip(variable: str) -> bool:
    """Whether a missing prerequisite fails instead of skipping: under CI (``CI`` set, other than 0/false; CI runs
    as root with every tool installed) or with ``variable`` set to 1."""
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false", "no") or os.environ.get(variable) == "1"


def unavailable(reason: str, variable: str = REQUIRE_BED) -> NoReturn:
    """Skip the test with ``reason`` (pytest -ra lists it in the summary), or fail with it where
    :func:`must_not_skip` says the machine must have what is missing."""
    if must_not_skip(variable):
        pytest.fail(f"{reason} (this machine must run it: CI or {variable}=1)", pytrace=False)
    pytest.skip(reason)


def installed_or_skip(check: Callable[[], object], missing: type[Exception]) -> None:
    """Run ``check``; when it raises ``missing`` (a Java or jars not installed), skip with its message, except under
    CI or KBIT_REQUIRE_APACHE_KAFKA=1 (fail with it: :func:`unavailable`)."""
    try:
        check()
    except missing as exc:
        unavailable(str(exc), REQUIRE_APACHE_KAFKA)


def require_apache_kafka() -> None:
    """Skip when Java or Apache Kafka's jars are missing, except under CI or KBIT_REQUIRE_APACHE_KAFKA=1 (fail)."""
    from kbit_core.brokers.apache_broker import java_binary, kafka_libs
    from kbit_core.errors import BrokerError

    installed_or_skip(lambda: (kafka_libs(), java_binary()), BrokerError)


@pytest.fixture(scope="session")
def apache_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Apache Kafka broker (single KRaft node, data on disk) for the whole session. Skipped when Java or its jars
    are missing (`scripts/run.sh install` puts them in .venv/kafka), except under CI or KBIT_REQUIRE_APACHE_KAFKA=1."""
    from kbit_core.brokers.apache_broker import ApacheKafkaBroker

    require_apache_kafka()
    b = ApacheKafkaBroker(tmp_path_factory.mktemp("apache-kafka"), port=free_port(), controller_port=free_port())
    b.start()
    yield b
    # Killed, not shut down: its data goes with the session, and a clean shutdown takes the longer the more
    # partitions the suite left (600: 21 s here; the session's last test paid 18 s). test_apache_kafka.py tests a
    # clean stop and restart.
    b.stop(timeout_s=0)


def require_schema_registry() -> None:
    """Skip when Apicurio Registry or a Java 21+ is missing, except under CI or KBIT_REQUIRE_APACHE_KAFKA=1 (fail)."""
    from kbit_core.brokers.schema_registry import RegistryServiceError, find_java, registry_app

    installed_or_skip(lambda: (registry_app(), find_java()), RegistryServiceError)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One real Schema Registry (kbit's local Apicurio Registry, in memory) for the whole session; tests register
    under subjects of their own topics. Its URL (the Confluent-compatible API) is ``schema_registry.url``."""
    from kbit_core.brokers.schema_registry import local_registry
    from kbit_core.config import LocalRegistryConfig

    require_schema_registry()
    local = LocalRegistryConfig(enabled=True, port=free_port(), management_port=free_port())
    service = local_registry(tmp_path_factory.mktemp("schema-registry"), local)
    service.start(timeout_s=180.0)
    yield service
    service.stop()


def embedded_settings(broker: Any) -> dict[str, Any]:
    """``kafka.embedded`` for a running test broker: its port and kind (and Apache Kafka's controller port)."""
    if getattr(broker, "kind", None) == "apache-kafka":
        return {"port": broker.port, "broker": "apache-kafka", "controller_port": broker.controller_port}
    return {"port": broker.port, "broker": "tansu"}


MLFLOW_TEMPLATE = TEST_HOME / "mlflow-template" / "mlflow.db"


def new_mlflow_store(path: Path) -> str:
    """The URI of a test's own MLflow sqlite store at ``path``, which starts as a copy of an empty store migrated once
    per session (MLflow's migrations of a new store take seconds, paid by every tracked test before)."""
    if importlib.util.find_spec("mlflow") is None:
        return f"sqlite:///{path}"  # a host without MLflow (the GPU machine's carried wheels) tracks nothing
    if not MLFLOW_TEMPLATE.exists():
        # mlflow takes seconds to import: loaded only by sessions with a tracked test
        from mlflow import MlflowClient

        MLFLOW_TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
        building = MLFLOW_TEMPLATE.with_suffix(".building")
        building.unlink(missing_ok=True)
        MlflowClient(f"sqlite:///{building}").search_experiments()
        building.rename(MLFLOW_TEMPLATE)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(MLFLOW_TEMPLATE, path)
    return f"sqlite:///{path}"


@pytest.fixture
def make_config(broker: EmbeddedBroker, tmp_path: Path) -> Callable[..., KbitConfig]:
    """Build a KbitConfig on the session broker with a per-test workdir and MLflow store (a copy of an empty one,
    :func:`new_mlflow_store`, when the config tracks).

    ``overrides`` is a nested dict; keyword arguments are dotted keys written with ``__``
    (``train__epochs=3``). Both win over the fixture's defaults.
    """
    store = tmp_path / "mlflow.db"

    def _make(overrides: dict[str, Any] | None = None, **dotted: Any) -> KbitConfig:
        embedded = embedded_settings(broker)
        data: dict[str, Any] = {
            "workdir": str(tmp_path / "kbit"),
            "kafka": {"embedded": embedded},
            "tracking": {"tracking_uri": f"sqlite:///{store}"},
        }
        # a copy: the dotted keys below write into nested dicts, which must not be a shared constant's (SMALL_TRAINING)
        data = deep_merge(data, copy.deepcopy(overrides or {}))
        for key, value in dotted.items():
            node = data
            *parents, leaf = key.split("__")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        cfg = KbitConfig.from_dict(data)
        if cfg.tracking.enabled and cfg.tracking_uri() == f"sqlite:///{store}":
            new_mlflow_store(store)
        return cfg

    return _make


@pytest.fixture
def topic_name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


# A small training run: 2000 records, one epoch of 25 steps per rank at global batch 64.
SMALL_TRAINING: dict[str, Any] = {
    "dataset": {"num_records": 2000},
    "produce": {"partitions": 2, "variant": {"format": "raw", "layout": "bytes", "compression": "lz4"}},
    "shard": {"split_rates": [0.8, 0.1, 0.1]},
    "train": {"epochs": 1, "global_batch_size": 64},
    "tracking": {"enabled": False},
}

REPO = Path(__file__).resolve().parents[1]
FAULT_MODELS_DIR = REPO / "tests" / "integration"


@pytest.fixture
def fault_models_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.model.name='fault_models:<factory>'`` works: torchrun children inherit the driver's environment."""
    monkeypatch.setenv("PYTHONPATH", f"{FAULT_MODELS_DIR}:{REPO}")


@pytest.fixture(scope="session")
def spark_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spark-session")


@pytest.fixture(scope="session")
def spark(spark_run_dir: Path) -> Iterator[object]:
    """The process's SparkSession (local[2], as the launch defaults), stopped with its JVM at the end."""
    from kbit_core.launch.spark import get_spark, stop_spark

    session = get_spark(KbitConfig.from_dict({"workdir": str(spark_run_dir)}))
    yield session
    stop_spark()


@pytest.fixture
def audited_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TMPDIR of its own, so a test can assert that a run left no torchelastic_* or tmp*/train.py there."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def _debris(*roots: Path | None) -> list[str]:
    found: list[str] = []
    for root in roots:
        if root is not None and root.is_dir():
            found += [str(p) for p in root.rglob("torchelastic_*")]
            found += [str(p) for p in root.rglob("train.py")]
    return found


@pytest.fixture
def launch_debris() -> Callable[..., list[str]]:
    """``launch_debris(*dirs)``: leftovers of torchrun (torchelastic_*) and TorchDistributor (tmp*/train.py)."""
    return _debris


@pytest.fixture(scope="session")
def ray_head_config(tmp_path_factory: pytest.TempPathFactory) -> KbitConfig:
    """The session head's settings: free ports for the head and its Ray Client server (Ray's default client port,
    10001, would be taken by a concurrent session's head)."""
    return KbitConfig.from_dict(
        {
            "workdir": str(tmp_path_factory.mktemp("ray-head")),
            "launch": {"engine": "ray", "ray_head_port": free_port(), "ray_client_server_port": free_port()},
        }
    )


@pytest.fixture(scope="session")
def ray_head_service(ray_head_config: KbitConfig) -> Iterator[Service]:
    """One local Ray head per test session, started as `kbit stack up --ray` starts it (127.0.0.1 only, on a free
    port, with Ray Client's server) and joined once by this process; stopped with every Ray process at the end."""
    from kbit_core.stack import ray_head

    head = ray_head(ray_head_config)
    head.start()
    yield head
    import ray

    ray.shutdown()
    head.stop()


def ray_head_settings(head: Service) -> dict[str, Any]:
    """``launch`` settings that run ranks on the session's Ray head, with the head's token."""
    return {
        "engine": "ray",
        "ray_address": head.url,
        "ray_auth_token_file": str(ray_env.own_token_file(head.run_dir)),
    }


@pytest.fixture
def make_ray_config(make_config: Callable[..., KbitConfig], ray_head_service: Service) -> Callable[..., KbitConfig]:
    """``make_config`` with ``launch.engine=ray`` on the session's Ray head."""

    def _make(overrides: dict[str, Any] | None = None, **dotted: Any) -> KbitConfig:
        return make_config(overrides, **dotted).override({"launch": ray_head_settings(ray_head_service)})

    return _make
