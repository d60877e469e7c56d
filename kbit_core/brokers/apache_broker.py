"""Start, stop and probe a local Apache Kafka 4.x broker: one KRaft node (broker and controller in one JVM) run from
the pinned jars (deployments/kafka/pom.xml, installed by scripts/install_kafka.sh), its data on disk in ``run_dir``.

Same surface as :class:`kbit_core.brokers.broker.EmbeddedBroker`; the process itself is a :class:`Service`. Unlike
Tansu it keeps topics across restarts (``run_dir/kafka/data``, formatted once with a cluster id kept in
``run_dir/kafka/cluster.id``) and answers ListOffsets(LATEST) exactly.
"""

from __future__ import annotations

import base64
import re
import shutil
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kbit_core.brokers.broker import BrokerStatus, ServiceBroker
from kbit_core.brokers.kafka_release import installed_kafka_versions, java_binary, kafka_libs, kafka_version
from kbit_core.errors import BrokerError
from kbit_core.service import Service

__all__ = ["ApacheKafkaBroker", "installed_kafka_versions", "java_binary", "kafka_libs", "kafka_version"]

# How long the one-off format run (a JVM start, ~2 s here) may take.
FORMAT_TIMEOUT_S = 120.0
# One metadata round trip while waiting for the broker to serve.
PROBE_TIMEOUT_S = 2.0
# The JVM as Kafka's own scripts start it (KAFKA_JVM_PERFORMANCE_OPTS), with GC threads sized for a small machine.
JVM_OPTS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:ParallelGCThreads=2",
    "-XX:ConcGCThreads=1",
    "-Djava.awt.headless=true",
)

# A server log line at WARN or ERROR: its level, then its message without the timestamp (_LOG4J2's pattern).
_LEVELED = re.compile(r"^\[[^\]]*\] (WARN|ERROR) (.*)$")


def new_cluster_id() -> str:
    """A Kafka cluster id as `kafka-storage random-uuid` makes one: 16 random bytes, URL-safe base64, unpadded,
    never starting with '-' (it would read as a command-line option)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def metadata_brokers(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """How many brokers a Metadata v4 request (no topics) lists: 0 until this node registered and is unfenced.
    Raises OSError when the broker cannot be reached or closes the connection."""
    client_id = b"kbit-ready"
    # header v1 (api key 3 = Metadata, version 4, correlation id 1, client id); body: topics = [], no auto-creation
    body = struct.pack(">hhih", 3, 4, 1, len(client_id)) + client_id + struct.pack(">ib", 0, 0)
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.settimeout(timeout_s)
        conn.sendall(struct.pack(">i", len(body)) + body)
        head = _read_exactly(conn, 4)
        resp = _read_exactly(conn, struct.unpack(">i", head)[0])
    # correlation id, throttle_time_ms, then the brokers array's length
    return struct.unpack(">i", resp[8:12])[0]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        data += chunk
    return data


class ApacheKafkaBroker(ServiceBroker):
    """One combined KRaft node (``process.roles=broker,controller``), its PID, logs, config and data in ``run_dir``.

    ``port`` serves clients (PLAINTEXT), ``controller_port`` (default ``port + 1``) the KRaft quorum; both bind to
    ``host``. The data survives restarts; :meth:`wipe` removes it. The keyword arguments past ``heap_max`` make it
    one node of a cluster (the test bed's): its ``node_id``, the quorum's ``voters``, ``overrides`` of its properties
    (listeners, security, replication), a ``launch`` wrapper of its command line (e.g. into a network namespace) and
    a ``ready`` check replacing the plaintext metadata probe.
    """

    kind = "apache-kafka"
    stop_timeout_s = 30.0  # a clean shutdown (SIGTERM) took 0.4-0.6 s here; the data stays

    def __init__(
        self,
        run_dir: Path,
        host: str = "127.0.0.1",
        port: int = 19092,
        *,
        controller_port: int | None = None,
        advertised: str | None = None,
        env: dict[str, str] | None = None,
        heap_min: str = "256m",
        heap_max: str = "1g",
        threads: int = 2,
        name: str = "kafka",
        node_id: int = 1,
        voters: str | None = None,
        overrides: dict[str, str] | None = None,
        launch: Callable[[list[str]], list[str]] | None = None,
        ready: Callable[[], bool] | None = None,
        jvm_opts: tuple[str, ...] = (),
        kafka_version: str | None = None,
    ) -> None:
        """``advertised`` (host:port) is what metadata tells clients to connect to, when that is not the listener;
        ``env`` is added to the process environment; ``threads`` sizes the network and I/O thread pools;
        ``jvm_opts`` follow JVM_OPTS on the broker's command line; ``kafka_version`` runs that release's jars
        (:func:`kafka_libs`) rather than the installed broker's, from its next start on."""
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port
        self.controller_port = controller_port if controller_port is not None else port + 1
        self.advertised = advertised or self.bootstrap
        self.heap_min, self.heap_max, self.threads = heap_min, heap_max, threads
        self.node_id = node_id
        self.voters = voters or f"{node_id}@{host}:{self.controller_port}"
        self.overrides = dict(overrides or {})
        self.launch, self.ready, self.jvm_opts = launch, ready, jvm_opts
        self.kafka_version = kafka_version
        self.home = self.run_dir / name
        self.data_dir = self.home / "data"
        self.properties_path = self.home / "server.properties"
        self.log4j_path = self.home / "log4j2.properties"
        self.server_log_path = self.home / "logs" / "server.log"
        self.cluster_id_path = self.home / "cluster.id"
        # the properties path names this broker's JVM, and no other process, in its command line
        self.service = Service(
            name,
            self.run_dir,
            argv=[],
            marker=str(self.properties_path),
            env=dict(env or {}),
            host=host,
            port=port,
            ready_ports=(self.controller_port,),
            url=self.bootstrap,
            port_setting="kafka.embedded.port or kafka.embedded.controller_port",
            error_type=BrokerError,
        )
        self._log_start: dict[Path, int] = {}

    def start(self, timeout_s: float = 60.0) -> BrokerStatus:
        """Start the broker unless ours already runs (formatting its log directory the first time); wait until it
        answers a metadata request listing itself. BrokerError with the log's tail when it does not."""
        deadline = time.monotonic() + timeout_s
        self._log_start = {path: _size(path) for path in (self.server_log_path, self.log_path)}
        if self.service.pid() is None:
            libs, java = kafka_libs(self.kafka_version), java_binary()
            self._write_config()
            self._format(java, libs)
            argv = [
                java,
                f"-Xms{self.heap_min}",
                f"-Xmx{self.heap_max}",
                *JVM_OPTS,
                *self.jvm_opts,
                f"-Dlog4j2.configurationFile={self.log4j_path}",
                f"-Dkafka.logs.dir={self.server_log_path.parent}",
                # Log4j would stop at SIGTERM, before the broker logs its own shutdown
                "-Dlog4j2.shutdownHookEnabled=false",
                "-cp",
                f"{libs}/*",
                "kafka.Kafka",
                str(self.properties_path),
            ]
            self.service.argv = self.launch(argv) if self.launch else argv
        try:
            self.service.start(max(1.0, deadline - time.monotonic()))
        except BrokerError:  # Service's message ends with stdout's tail; the server log says why
            reason = self.fatal_error()
            if reason is None:
                raise
            raise BrokerError(
                f"the Apache Kafka broker at {self.bootstrap} did not start: {reason}\n{self.why()}"
            ) from None
        self._wait_serving(deadline)
        return self.status()

    def wipe(self) -> None:
        """Delete the broker's data and cluster id (it must be stopped): the next start formats a fresh log."""
        if self.service.pid() is not None:
            raise BrokerError(f"the Apache Kafka broker at {self.bootstrap} is running; stop it before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.cluster_id_path.unlink(missing_ok=True)

    def version(self) -> str:
        return f"apache-kafka {self.kafka_version or kafka_version()}"

    def _log_lines(self, path: Path) -> list[str] | None:
        """``path``'s lines written since the latest start() (all of them before one, or after a rotation)."""
        try:
            with open(path, "rb") as f:
                start = self._log_start.get(path, 0)
                f.seek(start if start <= path.stat().st_size else 0)
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return None

    def log_tail(self, lines: int = 20) -> str:
        """The server log's last lines since the latest start, without Java stack frames (everything at INFO and
        above is there; the process's own output is in log_path)."""
        text = self._log_lines(self.server_log_path)
        if text is None:
            return self.service.log_tail(lines)
        return "\n".join([line for line in text if not line.startswith("\tat ")][-lines:])

    def why(self, limit: int = 8) -> str:
        """What the server log says since the latest start, up to the broker's first error: each distinct warning
        and error once (a retried connection warns every half second), the last ``limit`` of them. The cause is
        there; the shutdown that follows an error only logs that parts stopped. The log's tail when it has none."""
        seen: dict[str, str] = {}
        for line in self._log_lines(self.server_log_path) or []:
            leveled = _LEVELED.match(line)
            if leveled is None:
                continue
            seen.setdefault(leveled.group(2), leveled.group(1))
            if leveled.group(1) == "ERROR":
                break
        if not seen:
            return f"last lines of {self.server_log_path}:\n{self.log_tail()}"
        lines = [f"{level} {message}" for message, level in list(seen.items())[-limit:]]
        return f"its warnings and first error since it started ({self.server_log_path}):\n" + "\n".join(lines)

    def fatal_error(self) -> str | None:
        """The exception of the broker's last 'Exiting Kafka due to fatal exception' since the latest start."""
        for path in (self.server_log_path, self.log_path):
            lines = self._log_lines(path)
            if lines is None:
                continue
            for i in range(len(lines) - 1, -1, -1):
                if "fatal exception" in lines[i] or "Exiting Kafka" in lines[i]:
                    return lines[i + 1].strip() if i + 1 < len(lines) else lines[i]
        return None

    def cluster_id(self) -> str:
        """This broker's cluster id, made once and kept (the log directory is formatted with it)."""
        try:
            return self.cluster_id_path.read_text().strip()
        except FileNotFoundError:
            self.home.mkdir(parents=True, exist_ok=True)
            cid = new_cluster_id()
            self.cluster_id_path.write_text(cid + "\n")
            return cid

    def properties(self) -> dict[str, str]:
        """The broker's server.properties: by default one node, local listeners, replication factor 1 everywhere."""
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            # a static quorum: its addresses come from this file at every start, so ports may change
            "controller.quorum.voters": self.voters,
            "listeners": f"PLAINTEXT://{self.bootstrap},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.advertised}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.network.threads": str(self.threads),
            "num.io.threads": str(self.threads),
            "num.recovery.threads.per.data.dir": "1",
            "background.threads": "2",
            "num.partitions": "1",
            # kbit creates every topic it uses with its partition count; a typo must not create one
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "share.coordinator.state.topic.num.partitions": "1",
            "group.initial.rebalance.delay.ms": "0",
            # dataset topics are referenced by manifests: nothing is deleted by age or size
            "log.retention.ms": "-1",
        } | self.overrides

    def _write_config(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.server_log_path.parent.mkdir(parents=True, exist_ok=True)
        props = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        self.properties_path.write_text("# written by kbit_core.brokers.apache_broker at every start\n" + props)
        self.log4j_path.write_text(_LOG4J2.format(server_log=self.server_log_path))

    def _format(self, java: str, libs: Path) -> None:
        """Format the log directory once (KRaft needs it before the first start); a formatted one is kept."""
        if (self.data_dir / "meta.properties").is_file():
            return
        argv = [
            java,
            "-Xmx256m",
            # a one-off tool: C1 and the serial collector start it with ~40 % less CPU (measured 1.2 s vs 1.9 s)
            "-XX:TieredStopAtLevel=1",
            "-XX:+UseSerialGC",
            f"-Dlog4j2.configurationFile={self.log4j_path}",
            "-cp",
            f"{libs}/*",
            "kafka.tools.StorageTool",
            "format",
            "-t",
            self.cluster_id(),
            "-c",
            str(self.properties_path),
            "--ignore-formatted",
        ]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=FORMAT_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BrokerError(f"formatting the Apache Kafka log directory {self.data_dir} failed: {exc}") from None
        if done.returncode != 0:
            out = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("\tat ")]
            raise BrokerError(
                f"the Apache Kafka broker at {self.bootstrap} did not start: formatting its log "
                f"directory {self.data_dir} failed (exit {done.returncode}):\n" + "\n".join(out[-20:])
            )

    def _wait_serving(self, deadline: float) -> None:
        last = "no answer yet"
        while True:
            if self.service.pid() is None:
                raise BrokerError(
                    f"the Apache Kafka broker at {self.bootstrap} did not start: "
                    f"{self.fatal_error() or 'it exited'}\n{self.why()}"
                )
            try:
                if self.ready() if self.ready else metadata_brokers(self.host, self.port) > 0:
                    return
                last = "its metadata does not list it yet"
            except (OSError, struct.error) as exc:
                last = f"metadata request: {exc}"
            if time.monotonic() > deadline:
                self.service.stop()
                raise BrokerError(
                    f"the Apache Kafka broker at {self.bootstrap} did not serve metadata in time ({last})\n{self.why()}"
                )
            time.sleep(0.1)


# Everything at INFO into a rolling server.log under the run dir (the per-client config dumps, ~2,000 lines a start,
# left out); warnings and errors also on stdout, which Service appends to run_dir/kafka.log, never rotated: at most
# ~5 a second there (a client speaking a removed protocol version makes the broker log an error per request,
# measured 800 a second from one kafka-python consumer pinned to api_version=(0, 10)).
_LOG4J2 = """\
status = warn
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = {server_log}
appender.file.filePattern = {server_log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
appender.out.filter.burst.type = BurstFilter
appender.out.filter.burst.level = ERROR
appender.out.filter.burst.rate = 5
appender.out.filter.burst.maxBurst = 50
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
rootLogger.appenderRef.out.ref = STDOUT
rootLogger.appenderRef.out.level = WARN
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""
