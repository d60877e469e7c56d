"""The bed's team stack is the team profile on the driver's bed address, its own ports and the bed's brokers."""

from __future__ import annotations

from pathlib import Path

from kbit_core import bed_stack
from kbit_core.testbed.state import BedHost, BedState


def a_bed(bed_dir: Path) -> BedState:
    files = {name: bed_dir / name for name in ("ca.pem", "client.pem", "client.key", "kbit-train.password")}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
    return BedState(
        bed_dir=bed_dir,
        subnet="10.213.7.0/24",
        driver=BedHost(name="driver", address="10.213.7.1", netns=None),
        nodes=[BedHost(name="node1", address="10.213.7.11", netns="kbit-node1")],
        master_url="spark://10.213.7.1:7077",
        master_webui="http://10.213.7.1:8680",
        broker_bootstrap="10.213.7.1:19093,10.213.7.11:19093",
        sasl_username="kbit-train",
        sasl_password_file=files["kbit-train.password"],
        ssl_cafile=files["ca.pem"],
        ssl_certfile=files["client.pem"],
        ssl_keyfile=files["client.key"],
        options={},
    )


def test_the_team_stack_binds_the_drivers_bed_address_and_uses_the_beds_brokers(tmp_path: Path) -> None:
    cfg = bed_stack.team_config(a_bed(tmp_path / "testbed"))
    st = cfg.stack
    assert (st.host, st.database, st.artifacts, st.auth) == ("10.213.7.1", "postgresql", "s3", True)
    assert {name: getattr(st, name) for name in bed_stack.TEAM_PORTS} == bed_stack.TEAM_PORTS
    assert cfg.run_dir == (tmp_path / "testbed" / "team").resolve()
    assert cfg.tracking.tracking_uri == f"http://10.213.7.1:{bed_stack.TEAM_PORTS['mlflow_port']}"
    assert not cfg.kafka.uses_embedded and cfg.kafka.bootstrap_servers == "10.213.7.1:19093,10.213.7.11:19093"
