"""The test bed's rolling upgrade (`kbit cluster fault rolling-upgrade`): brokers brought up on an older Apache Kafka
release (`kbit cluster up --kafka-version 4.3.1`) restarted one by one on kbit's own release's jars (each a
controlled shutdown, then the cluster whole again, as in a rolling restart), then the cluster's finalized
``metadata.version`` (and the release's other feature levels: kraft.version, share.version, ...) raised to the new
release's with Kafka's own kafka-features tool and read back from the cluster.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.brokers.kafka_release import kafka_libs, kafka_version, run_kafka_tool
from kbit_core.errors import BrokerError
from kbit_core.testbed.certs import certificate_paths
from kbit_core.testbed.faults import BedBrokers, FaultReport, restart_broker
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.state import load_state, state_path

UPGRADE = "rolling-upgrade"
METADATA_VERSION = "metadata.version"
# One run of the kafka-features tool (a JVM start and an admin round trip; ~3 s here, far more on a loaded machine).
FEATURES_TIMEOUT_S = 180.0
# `kafka-features describe`: one line per feature the cluster knows
_DESCRIBED = re.compile(
    r"Feature: (?P<name>\S+)\s+SupportedMinVersion: (?P<min>\S+)\s+SupportedMaxVersion: (?P<max>\S+)\s+"
    r"FinalizedVersionLevel: (?P<level>\S+)"
)
# `kafka-features version-mapping`: `metadata.version=33 (4.4-IV2)` or `group.version=1`
_MAPPED = re.compile(r"^(?P<name>[\w.]+)=(?P<level>\d+)(?: \((?P<named>[^)]+)\))?$")


def release_of(version: str) -> str:
    """The release a version belongs to, as kafka-features names it: '4.4.0' -> '4.4'."""
    return ".".join(version.split(".")[:2])


def running_release(broker: ApacheKafkaBroker) -> str | None:
    """The Apache Kafka release whose jars ``broker``'s running JVM was started on (its class path), or None when it
    does not run."""
    pid = broker.service.pid()
    if pid is None:
        return None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    classpath = argv[argv.index("-cp") + 1] if "-cp" in argv else None
    return kafka_version(Path(classpath).parent) if classpath else None


class FeatureTool:
    """Kafka's kafka-features (``org.apache.kafka.tools.FeatureCommand``) from ``version``'s jars, against the
    brokers at ``bootstrap``, connecting with the Java client properties in ``command_config``."""

    def __init__(self, bootstrap: str, command_config: Path, version: str) -> None:
        self.bootstrap, self.config, self.version = bootstrap, command_config, version

    @classmethod
    def of_bed(cls, bed: BedBrokers, bed_dir: Path, version: str) -> FeatureTool:
        """The tool as the bed's brokers' super user on their internal listener (TLS with the brokers' certificate)."""
        certs = certificate_paths(Path(bed_dir) / "certs")
        config = Path(bed_dir) / "run" / "kafka-features.properties"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            "security.protocol=SSL\n"
            f"ssl.keystore.type=PEM\nssl.keystore.location={certs.server_keystore}\n"
            f"ssl.truststore.type=PEM\nssl.truststore.location={certs.ca}\n"
        )
        return cls(",".join(bed.cluster.admin_bootstrap(n) for n in bed.cluster.nodes), config, version)

    def _run(self, *args: str) -> str:
        connect = ["--bootstrap-server", self.bootstrap, "--command-config", str(self.config)]
        return run_kafka_tool("FeatureCommand", [*connect, *args], FEATURES_TIMEOUT_S, self.version)

    def finalized(self) -> dict[str, str]:
        """Feature -> its finalized level as the cluster reports it now (``metadata.version`` by name, e.g. 4.3-IV0;
        the others by number)."""
        found = {m["name"]: m["level"] for m in _DESCRIBED.finditer(self._run("describe"))}
        if METADATA_VERSION not in found:
            raise TestbedError(f"kafka-features describe did not report {METADATA_VERSION} at {self.bootstrap}")
        return found

    def release_levels(self) -> dict[str, str]:
        """Feature -> the latest production level of this tool's release (``metadata.version`` by name, e.g.
        4.4-IV2), from its own mapping: what ``upgrade --release-version`` of its release finalizes."""
        out = self._run("version-mapping")
        mapped = [m for m in (_MAPPED.match(line.strip()) for line in out.splitlines()) if m]
        return {m["name"]: m["named"] or m["level"] for m in mapped}

    def upgrade(self) -> None:
        """Finalize every feature at this tool's release's level (`kafka-features upgrade --release-version`)."""
        self._run("upgrade", "--release-version", release_of(self.version))


def rolling_upgrade(bed_dir: Path) -> FaultReport:
    """Restart each broker that does not run kbit's own Apache Kafka release on its jars, in turn (a rolling
    restart's step each); record the release in the bed's state; then raise the finalized ``metadata.version`` and
    the other features to the release's levels and read them back: TestbedError naming any that differ. Brokers
    already on the release are skipped, so a failed upgrade is run again."""
    bed_dir = Path(bed_dir).resolve()
    state = load_state(bed_dir)
    if state is None:
        raise TestbedError(f"no test bed is up at {bed_dir}: `kbit cluster up --kafka-version OLDER` first")
    target = kafka_version(kafka_libs())
    bed = BedBrokers.from_state(state)
    tool = FeatureTool.of_bed(bed, bed_dir, target)
    report = FaultReport(UPGRADE)
    started = time.monotonic()
    before = tool.finalized()
    for broker in bed.cluster.brokers:
        was = running_release(broker)
        if was is None:
            raise TestbedError(f"the bed's broker {broker.service.name} is not running: the upgrade needs all of them")
        if was == target:
            report.steps.append({"broker": broker.service.name, "release": target, "skipped": "already on it"})
            continue
        broker.kafka_version = None  # kbit's own release
        report.steps.append({**restart_broker(bed, broker), "release": f"{was} -> {target}"})
    state_path(bed_dir).write_text(
        state.model_copy(update={"options": {**state.options, "kafka_version": None}}).model_dump_json(indent=2)
    )
    bumping = time.monotonic()
    wanted = tool.release_levels()
    try:
        tool.upgrade()
    except BrokerError as exc:
        raise TestbedError(
            f"raising the bed's feature levels to release {release_of(target)}'s failed: {exc}"
        ) from None
    after = tool.finalized()
    short = {
        name: f"{after.get(name, 'none')} (not {level})" for name, level in wanted.items() if after.get(name) != level
    }
    if short:
        raise TestbedError(
            f"after the upgrade to release {release_of(target)} the bed's finalized features are not the release's: "
            + ", ".join(f"{name} {found}" for name, found in short.items())
        )
    report.steps.append(
        {"features_before": before, "features_after": after, "bump_s": round(time.monotonic() - bumping, 1)}
    )
    report.seconds = time.monotonic() - started
    return report
