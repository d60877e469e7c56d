"""`kbit cluster up | down | status | ray-env | fault`: the multi-host test bed (namespaces, TLS broker, Spark, Ray)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kbit_core import bed_stack
from kbit_core.cli.common import ConfigOpt, JsonOpt, SetOpt, load_cli_config, print_json, run_guarded
from kbit_core.testbed import DEFAULT_SUBNET, BedOptions, BedState, BedStatus, ray_launcher, ssh_hosts
from kbit_core.testbed import down as bed_down
from kbit_core.testbed import status as bed_status
from kbit_core.testbed import up as bed_up
from kbit_core.testbed.disk_faults import DISK_FAULTS, fill_disk
from kbit_core.testbed.faults import FAULTS, BedBrokers, cut_off, kill_controller, rolling_restart
from kbit_core.testbed.upgrade import UPGRADE, rolling_upgrade

ALL_FAULTS = (*FAULTS, *DISK_FAULTS, UPGRADE)
cluster_app = typer.Typer(help="Start, stop and inspect the multi-host test bed (root on Linux).", no_args_is_help=True)
out = Console()
TeamStackOpt = Annotated[
    bool,
    typer.Option(
        help="Also run the team stack on the driver host's bed address: PostgreSQL, s3proxy, Prefect's and MLflow's "
        "servers behind kbit's login, a worker; on a bed that is up, start it there (docs/orchestration.md)."
    ),
]


def _bed_dir(config: Path | None, sets: list[str] | None) -> Path:
    return run_guarded(load_cli_config, config, sets).run_dir / "testbed"


def _report(st: BedStatus, as_json: bool) -> None:
    if as_json:
        print_json(st.to_dict())
        return
    if st.state is None:
        out.print(
            "the test bed is not up"
            + (" (leftovers found: run `kbit cluster down`)" if st.bridge or st.namespaces else "")
        )
        return
    s = st.state
    hosts = Table(title=f"kbit test bed ({s.subnet}) — {'[green]up[/]' if st.up else '[red]degraded[/]'}")
    for col in ("host", "address", "namespace", "worker"):
        hosts.add_column(col)
    hosts.add_row(s.driver.name, s.driver.address, "(root)", "-")
    for n in s.nodes:
        hosts.add_row(
            n.name,
            n.address,
            n.netns or "-",
            "[green]ALIVE[/]" if n.address in st.alive_workers else "[red]not registered[/]",
        )
    procs = Table(title="processes")
    for col in ("process", "host", "state", "pid", "hostname", "log"):
        procs.add_column(col, overflow="fold")  # paths are copied from here: never elide them
    for p in st.processes:
        procs.add_row(
            p.name,
            f"{p.host} ({p.address})",
            "[green]alive[/]" if p.alive else "[red]dead[/]",
            str(p.pid or "-"),
            p.hostname or "-",
            p.log,
        )
    out.print(hosts, procs)
    out.print(
        f"Spark master: {s.master_url} (UI {s.master_webui})\n"
        f"Kafka bootstrap: {s.broker_bootstrap} ({s.security_protocol}, {s.sasl_username}, up in {s.broker_up_s} s); "
        f"CA {s.ssl_cafile}"
        + (f"; client cert {s.ssl_certfile}, key {s.ssl_keyfile}" if s.ssl_certfile else "")
        + (
            f"\nRay: {s.ray_address} (Ray Client; token {s.ray_overrides()['launch.ray_auth_token_file']}); "
            f"nodes alive: {', '.join(st.ray_nodes) or 'none'}"
            if s.ray_address
            else "\nRay: not installed, not started"
        )
        + (f"\nSchema Registry: {s.registry_url} (up in {s.registry_up_s} s)" if s.registry_url else "")
        + _team_line(s)
        + (
            f'\nRay\'s cluster launcher: eval "$(kbit cluster ray-env)"; ray up -y {s.ray_cluster_yaml} '
            f"(SSH to the node hosts as root with {ssh_hosts.client_key(s.bed_dir)})"
            if s.ray_cluster_yaml
            else "\nsshd: not on the node hosts (apt-get install openssh-server rsync), no `ray up`"
        )
        + "".join(f"\nlink {name}: {shape}" for name, shape in st.links.items())
        + f"\nstate file: {s.bed_dir / 'state.json'}"
    )


def _team_line(s: BedState) -> str:
    team = s.team_stack
    if team is None:
        return ""
    return (
        f"\nTeam stack: Prefect {team.prefect_api_url}, MLflow {team.mlflow_url} (PostgreSQL, s3proxy; login in "
        f'{team.workdir}/state/credentials; up in {team.up_s} s): eval "$(kbit cluster team-env)"'
    )


@cluster_app.command("up")
def up(
    config: ConfigOpt = None,
    sets: SetOpt = None,
    subnet: Annotated[
        str, typer.Option(help="Private subnet of the bed; the driver takes .1, nodes .11, .12, ...")
    ] = DEFAULT_SUBNET,
    nodes: Annotated[int, typer.Option(min=1, max=8, help="Worker hosts (network namespaces).")] = 2,
    broker_port: Annotated[
        int, typer.Option(help="Client port (SASL_SSL) of the broker on every bed address.")
    ] = 19093,
    client_auth: Annotated[bool, typer.Option(help="Require client certificates (mutual TLS).")] = True,
    link: Annotated[
        str | None,
        typer.Option(
            help="Shape every link in both directions: RATE[,DELAY[,LOSS]], e.g. 1gbit,0.5ms or 100mbit,2ms,0.1% "
            "(docs/network.md)."
        ),
    ] = None,
    registry: Annotated[
        bool,
        typer.Option(
            help="Also run a Schema Registry (Apicurio, in memory) on the driver host's bed address, for the node "
            "hosts; on a bed that is up, start it there (docs/network.md)."
        ),
    ] = False,
    team_stack: TeamStackOpt = False,
    log_disk_mb: Annotated[
        int | None,
        typer.Option(min=16, help="Each broker's log directory on a filesystem of its own of this size (fill-disk)."),
    ] = None,
    kafka_version: Annotated[
        str | None,
        typer.Option(
            help="Run the brokers on this installed Apache Kafka release (e.g. 4.3.1, which `scripts/run.sh install` "
            "installs), formatted with its metadata.version; `kbit cluster fault rolling-upgrade` upgrades them."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create the hosts, start Kafka on every host (TLS, SCRAM users, ACLs), Spark, (`ray` extra) Ray on the node hosts,
    (--registry) a Schema Registry and (--team-stack) the team stack on the driver host; wait until healthy."""
    bed_dir = _bed_dir(config, sets)
    was_up = run_guarded(bed_status, bed_dir).up
    options = BedOptions(
        subnet=subnet,
        nodes=nodes,
        broker_port=broker_port,
        client_auth=client_auth,
        link=link,
        registry=registry,
        log_disk_mb=log_disk_mb,
        kafka_version=kafka_version,
    )
    with out.status("starting the test bed (three Kafka brokers, then Spark and Ray)..."):
        run_guarded(bed_up, bed_dir, options)
    if team_stack:
        _start_team_stack(bed_dir)
    if was_up and not as_json:
        out.print("the test bed is already up")
    _report(bed_stack.with_team_stack(run_guarded(bed_status, bed_dir)), as_json)


def _start_team_stack(bed_dir: Path) -> None:
    with out.status("starting the team stack (PostgreSQL, s3proxy, Prefect, MLflow, worker)..."):
        run_guarded(bed_stack.start, bed_dir)


@cluster_app.command("down")
def down(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Stop every process and remove every namespace and link the bed made (also after a crash)."""
    bed_dir = _bed_dir(config, sets)
    removed = run_guarded(bed_stack.stop, bed_dir) + run_guarded(bed_down, bed_dir)
    out.print(f"removed: {', '.join(removed)}" if removed else "nothing was up")


@cluster_app.command("status")
def status(config: ConfigOpt = None, sets: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Show hosts, addresses, hostnames, processes and logs; exit code 1 when the bed is not fully up."""
    st = bed_stack.with_team_stack(run_guarded(bed_status, _bed_dir(config, sets)))
    _report(st, as_json)
    if not st.up:
        raise typer.Exit(code=1)


@cluster_app.command("ray-env")
def ray_env(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Print `export` lines that keep `ray up | exec | down` on this host in the bed's directories (not /tmp/ray or
    ~): eval "$(kbit cluster ray-env)"; then `ray up -y <the cluster.yaml `kbit cluster status` names>`."""
    for key, value in ray_launcher.launcher_env(_bed_dir(config, sets)).items():
        print(f"export {key}={shlex.quote(value)}")


@cluster_app.command("team-env")
def team_env(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Print `export` lines that point the `prefect` and `mlflow` CLIs and kbit at the bed's team stack, logged in
    (the password read from its 0600 file, never printed): eval "$(kbit cluster team-env)"."""
    for key, value in run_guarded(bed_stack.shell_env, _bed_dir(config, sets)).items():
        print(f"export {key}={value}")


@cluster_app.command("fault")
def fault(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(ALL_FAULTS)}.")],
    broker: Annotated[
        str | None,
        typer.Option(
            help="cut-off: the host whose broker to cut off (driver, node1, ...); fill-disk: the host(s) whose "
            "broker's disk to fill, comma-separated."
        ),
    ] = None,
    topic: Annotated[
        str | None, typer.Option(help="cut-off, fill-disk: the leader of this topic's --partition.")
    ] = None,
    partition: Annotated[int, typer.Option(help="cut-off, fill-disk: the partition whose leader it is.")] = 0,
    seconds: Annotated[
        float,
        typer.Option(
            min=0, help="cut-off: how long the broker stays cut off; fill-disk: at least how long the disk stays full."
        ),
    ] = 30.0,
    until_fenced: Annotated[
        bool, typer.Option(help="cut-off: and on until the controller fenced it (its session timed out).")
    ] = False,
    config: ConfigOpt = None,
    sets: SetOpt = None,
) -> None:
    """Do to the running bed's Kafka what an operator does (docs/reliability.md), then wait until the cluster is
    whole again; prints what was done, timed, as JSON."""
    if name not in ALL_FAULTS:
        raise typer.BadParameter(f"unknown fault {name!r}; one of: {', '.join(ALL_FAULTS)}", param_hint="NAME")
    if name in ("cut-off", "fill-disk") and (broker is None) == (topic is None):
        raise typer.BadParameter(f"{name} needs exactly one of --broker HOST or --topic TOPIC [--partition P]")
    if name == UPGRADE:
        print_json(run_guarded(rolling_upgrade, _bed_dir(config, sets)).to_dict())
        return
    bed = run_guarded(BedBrokers.of, _bed_dir(config, sets))
    if name == "rolling-restart":
        report = run_guarded(rolling_restart, bed)
    elif name == "kill-controller":
        report = run_guarded(kill_controller, bed)
    elif name == "fill-disk":
        hosts = broker.split(",") if broker else []
        victims = [run_guarded(bed.broker, h)[0] for h in hosts] or [run_guarded(bed.leader_of, topic, partition)[0]]
        report = run_guarded(fill_disk, bed, victims, seconds)
    else:
        victim, host = run_guarded(bed.broker, broker) if broker else run_guarded(bed.leader_of, topic, partition)
        report = run_guarded(cut_off, bed, victim, host, seconds, until_fenced)
    print_json(report.to_dict())


def register(app: typer.Typer) -> None:
    """Add the `cluster` command group to the root app."""
    app.add_typer(cluster_app, name="cluster")
