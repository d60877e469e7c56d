"""The network axis's pure parts: network profile names and the compression crossover."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kbit_core.config import KbitConfig
from kbit_core.errors import StatisticsError
from kbit_core.jobs.benchmark import matrix, network_rates
from kbit_core.stats.crossover import crossover, network_markdown, network_section, pays_below
from kbit_core.testbed.network import TestbedError
from kbit_core.testbed.shaping import LinkShape, network_shape

RATES = [1e10, 1e9, 1e8]


def makespans(cpu_s: float, wire_bits: float, seed: int, n: int = 8, noise: float = 0.002) -> dict[float, list[float]]:
    """Samples of ``t = cpu + wire/rate`` on each of RATES, with a little noise."""
    rng = np.random.default_rng(seed)
    return {r: list(cpu_s + wire_bits / r + rng.normal(0, noise, n)) for r in RATES}


def test_network_shape_reads_profile_names():
    assert network_shape("loopback") is None
    assert network_shape("100mbit-2ms") == LinkShape(100_000_000, 0.002)
    assert network_shape("10gbit-0.2ms") == LinkShape(10**10, 0.0002)
    assert network_shape("1gbit-0.5ms-1%") == LinkShape(10**9, 0.0005, 0.01)
    assert network_shape("1gbit") == LinkShape(10**9)


def test_network_shape_names_the_bad_profile():
    with pytest.raises(TestbedError, match=r"bench.networks\[1\] '100mbps-2ms': rate '100mbps'"):
        network_shape("100mbps-2ms", where="bench.networks[1]")


def test_crossover_recovers_the_rate_where_lines_cross():
    # none: 0.10 s of CPU, 80 Mbit on the wire; lz4: 0.15 s of CPU, 30 Mbit -> lz4 pays below 50 Mbit / 0.05 s = 1 Gbit/s
    found = crossover(makespans(0.10, 80e6, seed=1), makespans(0.15, 30e6, seed=2), resamples=500)
    assert found.pays_below_bit_s == pytest.approx(1e9, rel=0.1)
    assert found.ci_low_bit_s < 1e9 < found.ci_high_bit_s
    assert found.pays_share == 1.0  # at 100 Mbit/s it saves 0.45 s: every resample agrees
    assert found.verdict().startswith("pays below 1")


def test_crossover_on_noise_alone_has_a_wide_interval():
    # the same line for both: whether the codec pays is a coin toss, and the interval must say so
    found = crossover(makespans(0.1, 1e6, seed=3, noise=0.01), makespans(0.1, 1e6, seed=4, noise=0.01), resamples=500)
    assert 0.05 < found.pays_share < 0.95


def test_pays_below_covers_every_arrangement():
    assert pays_below((1.0, 10.0), (2.0, 5.0)) == 5.0  # costs 1 s more CPU, saves 5 bits
    assert math.isinf(pays_below((1.0, 10.0), (0.5, 5.0)))  # cheaper and smaller: pays everywhere
    assert pays_below((1.0, 10.0), (2.0, 12.0)) == 0.0  # dearer and larger: never
    assert math.isnan(pays_below((1.0, 10.0), (0.5, 12.0)))  # cheaper but larger: only on fast links


def test_crossover_refuses_a_single_network_and_bad_samples():
    with pytest.raises(StatisticsError, match="at least two networks"):
        crossover({1e9: [1.0]}, {1e9: [1.0]})
    with pytest.raises(StatisticsError, match="non-finite samples on the 100 Mbit/s link"):
        crossover({1e9: [1.0], 1e8: [math.nan]}, {1e9: [1.0], 1e8: [1.0]})
    with pytest.raises(StatisticsError, match="different networks"):
        crossover({1e9: [1.0], 1e8: [1.0]}, {1e9: [1.0], 1e7: [1.0]})


def test_network_section_pairs_codecs_with_their_uncompressed_twin():
    names = {"loopback": None, "1gbit-0.5ms": 1e9, "100mbit-2ms": 1e8}
    lines = {"none": (0.10, 80e6), "lz4": (0.15, 30e6)}
    configs, raw, stats = {}, {}, {}
    for net, rate in names.items():
        for compression, (cpu, wire) in lines.items():
            name = f"avro_list_{compression}.confluent@{net}"
            values = [cpu + (wire / rate if rate else 0) + 0.001 * i for i in range(5)]
            configs[name] = {"format": "avro", "layout": "list", "compression": compression, "network": net}
            raw[name] = values
            stats[name] = {"median": float(np.median(values))}
    doc = {"configurations": configs, "makespan": {"raw_results": raw, "statistical_analysis": stats}}
    section = network_section(doc, names, resamples=200, seed=0)
    assert section["fastest"]["loopback"]["configuration"] == "avro_list_none.confluent@loopback"
    assert section["fastest"]["100mbit-2ms"]["configuration"] == "avro_list_lz4.confluent@100mbit-2ms"
    [found] = section["crossovers"]
    assert found["pays_below_bit_s"] == pytest.approx(1e9, rel=0.05)
    assert "| avro_list lz4 vs none" in network_markdown(section)


def test_matrix_has_a_network_axis_and_refuses_a_bad_profile():
    cfg = KbitConfig.from_dict({"bench": {"variants": [{"format": "avro"}], "networks": ["loopback", "100mbit-2ms"]}})
    assert [(c.name, c.network) for c in matrix(cfg)] == [
        ("avro_list_lz4.confluent@loopback", "loopback"),
        ("avro_list_lz4.confluent@100mbit-2ms", "100mbit-2ms"),
    ]
    assert network_rates(["loopback", "1gbit-0.5ms"]) == {"loopback": None, "1gbit-0.5ms": 10**9}
    bad = cfg.override({"bench.networks": ["loopback", "1gbit-5"]})
    with pytest.raises(TestbedError, match=r"bench.networks\[1\] '1gbit-5': delay '5' needs a number and one of"):
        matrix(bad)
