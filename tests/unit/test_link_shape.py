"""`--link RATE[,DELAY[,LOSS]]`: what it accepts, what it refuses (one line naming the part), and what it builds."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kbit_core.cli import app
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.shaping import LinkEnd, LinkShape, delay_ruleset, loss_ruleset, tbf_command


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        ("1gbit", LinkShape(10**9)),
        ("1gbit,0.5ms", LinkShape(10**9, 0.0005)),
        ("100mbit,2ms,0.1%", LinkShape(10**8, 0.002, 0.001)),
        (" 10Gbit , 200us ", LinkShape(10**10, 0.0002)),
        ("2.5mbit,1s,5%", LinkShape(2_500_000, 1.0, 0.05)),
    ],
)
def test_link_specs_parse_and_print_back(spec: str, shape: LinkShape):
    assert LinkShape.parse(spec) == shape
    assert LinkShape.parse(shape.spec()) == shape


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("", "expected RATE[,DELAY[,LOSS]]"),
        ("1gbit,2ms,1%,3", "expected RATE[,DELAY[,LOSS]]"),
        ("1gbit,,1%", "expected RATE[,DELAY[,LOSS]]"),
        ("100", "rate '100' needs a number and one of bit, kbit, mbit, gbit"),
        ("100mbps", "rate '100mbps'"),
        ("1gbit,2", "delay '2' needs a number and one of us, ms, s"),
        ("1gbit,2ms,0.1", "loss '0.1' must be a percentage below 100%"),
        ("1gbit,2ms,100%", "loss '100%'"),
        ("10kbit", "rate 10kbit is outside 100kbit..100gbit"),
        ("1gbit,11s", "delay 11s is over 10s"),
    ],
)
def test_bad_link_specs_name_the_part(spec: str, names: str):
    with pytest.raises(TestbedError) as err:
        LinkShape.parse(spec, where="--link")
    assert str(err.value).startswith(f"--link {spec!r}: ") and names in str(err.value)
    assert "\n" not in str(err.value)


def test_commands_carry_the_shape():
    shape = LinkShape.parse("100mbit,2ms,0.1%")
    node_end = LinkEnd("kbit-node1", "eth0")
    assert tbf_command(node_end, shape)[:4] == ["ip", "netns", "exec", "kbit-node1"]
    assert "100000000bit" in tbf_command(LinkEnd(None, "kbit-node1"), shape)
    assert "numgen random mod 1000000 < 1000 counter drop" in loss_ruleset(node_end, shape)
    assert 'device "eth0"' in loss_ruleset(node_end, shape)
    assert LinkEnd(None, "kbit-node1").table == "kbit_loss_kbit_node1"
    rules = delay_ruleset("eth0", 7999, shape)
    assert "redirect to :7999" in rules and "tcp dport != 7999" in rules and 'comment "delay 2ms"' in rules
    # only openings: a connection picked up mid-stream when the table appears must not be sent to the relay
    assert rules.count("tcp flags & (syn | ack) == syn") == 2
    # connections to the node only for a port it serves: the relay must not answer for a port nobody listens on
    assert rules.count("socket wildcard { 0, 1 } redirect") == 1 and "syn redirect" in rules
    assert shape.describe() == "100 mbit/s, 2 ms each way (TCP), 0.1% loss, in both directions"


def test_cluster_up_refuses_a_bad_link_before_touching_anything(tmp_path: Path):
    result = CliRunner().invoke(app, ["cluster", "up", "--set", f"workdir={tmp_path}", "--link", "100mbps,2ms"])
    assert result.exit_code == 1
    assert "--link '100mbps,2ms': rate '100mbps' needs a number and one of bit, kbit, mbit, gbit" in result.output
    assert not (tmp_path / "testbed").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["reboot"], "unknown fault 'reboot'; one of: rolling-restart, cut-off, kill-controller"),
        (["cut-off"], "cut-off needs exactly one of --broker HOST or --topic TOPIC"),
        (["fill-disk"], "fill-disk needs exactly one of --broker HOST or --topic TOPIC"),
        (["fill-disk", "--broker", "node1"], "no test bed is up at"),
        (["kill-controller"], "no test bed is up at"),
    ],
)
def test_cluster_fault_refuses_what_it_cannot_do_before_touching_anything(tmp_path: Path, args, named):
    result = CliRunner().invoke(app, ["cluster", "fault", *args, "--set", f"workdir={tmp_path}"])
    assert result.exit_code != 0
    assert named in " ".join(result.output.replace("│", " ").split()), result.output  # the words, unwrapped
