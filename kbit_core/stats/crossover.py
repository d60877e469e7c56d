"""The network axis of a benchmark report: the fastest configuration per network, and for each compression codec
the link rate below which it starts to pay against the same configuration uncompressed.

The crossover comes from a two-parameter model of a configuration's makespan on a link of rate ``r``:
``t(r) = cpu + wire / r`` (``cpu``: the seconds that do not depend on the link, compressing and decoding
included; ``wire``: the bits that cross it). Fitted by least squares over the networks measured (an unshaped link
counts as ``1/r = 0``: the link is not what bounds it), a codec pays where its line lies below the uncompressed
one: below ``r* = (wire_none - wire_codec) / (cpu_codec - cpu_none)``. Its confidence is a percentile bootstrap:
every network's samples of both configurations resampled with replacement, the lines fitted again, ``r*`` again.
Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kbit_core.errors import StatisticsError

CONFIDENCE = 0.95
UNCOMPRESSED = "none"
# Fields that make two configurations the same but for their compression (and their network).
_PAIR_FIELDS = ("format", "layout", "records_per_message", "client", "batch_size", "world_size")

# samples per network: {link rate in bit/s (math.inf for an unshaped link): makespans in seconds}
Samples = Mapping[float, Sequence[float]]


@dataclass(frozen=True)
class Crossover:
    """Where ``codec`` starts to pay against ``reference`` (the same configuration, uncompressed).

    ``pays_below_bit_s``: the codec is faster on links slower than this (``inf``: on every link; 0: on none);
    None when it is faster only on *fast* links (it ships more bytes but costs less CPU). ``ci_*``: the bootstrap
    interval of that rate (percentiles over the resamples, ``inf``/0 included). ``pays_share``: the share of
    resamples in which the codec pays on the slowest network measured.
    """

    codec: str
    reference: str
    pays_below_bit_s: float | None
    ci_low_bit_s: float | None
    ci_high_bit_s: float | None
    pays_share: float
    resamples: int
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        # JSON has no infinity: an unbounded rate is written as the string "inf"
        return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(self).items()}

    def verdict(self) -> str:
        if self.pays_below_bit_s is None:
            return "pays only on fast links"
        if self.pays_below_bit_s == 0:
            return "never pays"
        if math.isinf(self.pays_below_bit_s):
            return "pays on every link"
        return f"pays below {human_rate(self.pays_below_bit_s)}"


def human_rate(bit_s: float | None) -> str:
    if bit_s is None:
        return "-"
    if math.isinf(bit_s):
        return "∞"
    for unit, factor in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bit_s >= factor:
            return f"{bit_s / factor:.3g} {unit}"
    return f"{bit_s:.3g} bit/s"


def fit_line(inverse_rates: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """``(cpu_s, wire_bits)`` of ``t = cpu + wire * (1/r)`` by least squares."""
    wire, cpu = np.polyfit(inverse_rates, times, 1)
    return float(cpu), float(wire)


def pays_below(reference: tuple[float, float], codec: tuple[float, float]) -> float:
    """The rate below which ``codec``'s line lies under ``reference``'s; ``inf`` on every link, 0 on none, NaN
    when it lies under only above a rate."""
    extra_cpu = codec[0] - reference[0]
    saved_wire = reference[1] - codec[1]
    if extra_cpu > 0:
        return max(saved_wire, 0.0) / extra_cpu
    if saved_wire >= 0:
        return math.inf
    return math.nan


def _checked(samples: Samples, name: str) -> tuple[np.ndarray, list[np.ndarray]]:
    rates = sorted(samples, reverse=True)
    if len(rates) < 2:
        raise StatisticsError(f"crossover of {name!r} needs samples on at least two networks, got {len(rates)}")
    arrays = [np.asarray(samples[r], dtype=np.float64) for r in rates]
    for rate, values in zip(rates, arrays):
        if values.size == 0 or not np.isfinite(values).all():
            raise StatisticsError(f"crossover of {name!r}: no or non-finite samples on the {human_rate(rate)} link")
    if rates[-1] <= 0:
        raise StatisticsError(f"crossover of {name!r}: link rate {rates[-1]} is not positive")
    return np.array([0.0 if math.isinf(r) else 1.0 / r for r in rates]), arrays


def crossover(
    reference: Samples,
    codec: Samples,
    *,
    names: tuple[str, str] = ("codec", "reference"),
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Crossover:
    """The crossover of ``codec`` against ``reference``, both measured on the same networks (the keys)."""
    if set(reference) != set(codec):
        raise StatisticsError(f"{names[0]!r} and {names[1]!r} were measured on different networks")
    inverse, ref_arrays = _checked(reference, names[1])
    _, codec_arrays = _checked(codec, names[0])

    def estimate(ref: list[np.ndarray], cod: list[np.ndarray]) -> float:
        medians = [np.array([np.median(a) for a in arrays]) for arrays in (ref, cod)]
        return pays_below(fit_line(inverse, medians[0]), fit_line(inverse, medians[1]))

    rng = np.random.default_rng(seed)

    def resample(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [rng.choice(a, size=a.size, replace=True) for a in arrays]

    boot = np.array([estimate(resample(ref_arrays), resample(codec_arrays)) for _ in range(resamples)])
    slowest = 1.0 / inverse[-1]
    pays_share = float(np.mean(np.nan_to_num(boot, nan=0.0) > slowest))
    finite = boot[~np.isnan(boot)]  # resamples where it pays only above a rate have no "pays below"
    tail = (1 - confidence) / 2
    low, high = (
        (float(q) for q in np.quantile(finite, [tail, 1 - tail], method="inverted_cdf"))
        if finite.size
        else (None, None)
    )
    point = estimate(ref_arrays, codec_arrays)
    return Crossover(
        codec=names[0],
        reference=names[1],
        pays_below_bit_s=None if math.isnan(point) else point,
        ci_low_bit_s=low,
        ci_high_bit_s=high,
        pays_share=pays_share,
        resamples=resamples,
        confidence=confidence,
    )


def network_section(
    doc: Mapping[str, Any], rates: Mapping[str, float | None], *, resamples: int, seed: int
) -> dict[str, Any]:
    """The report's ``network`` section from a stats document whose configurations carry a ``network`` field.

    ``rates``: each network's link rate in bit/s (None: unshaped). Per network the fastest configuration by
    median makespan; for every compressed configuration whose uncompressed twin was measured on the same
    networks, its :class:`Crossover` (only with two networks or more).
    """
    configs = doc["configurations"]
    medians = {n: s["median"] for n, s in doc["makespan"]["statistical_analysis"].items()}
    fastest = {}
    for network in rates:
        names = [n for n in configs if configs[n].get("network") == network]
        if names:
            best = min(names, key=medians.__getitem__)
            fastest[network] = {"configuration": best, "makespan_median_s": medians[best]}
    section: dict[str, Any] = {
        "networks": {k: {"rate_bit_s": v} for k, v in rates.items()},
        "fastest": fastest,
        "crossovers": [],
    }
    if len(rates) < 2:
        return section
    samples = doc["makespan"]["raw_results"]
    for key, by_compression in _twins(configs).items():
        reference = by_compression.get(UNCOMPRESSED)
        if reference is None:
            continue
        for compression, codec in sorted(by_compression.items()):
            if compression == UNCOMPRESSED or set(codec) != set(reference):
                continue
            fields = dict(zip(_PAIR_FIELDS, key))
            base = f"{fields['format']}_{fields['layout']}"
            label = f"{base} {compression} vs none ({fields['client']}, batch {fields['batch_size']}, world {fields['world_size']})"
            found = crossover(
                {_rate(rates[net]): samples[name] for net, name in reference.items()},
                {_rate(rates[net]): samples[name] for net, name in codec.items()},
                names=(label, f"{base} none"),
                resamples=resamples,
                seed=seed,
            )
            section["crossovers"].append({**found.to_dict(), "verdict": found.verdict()})
    return section


def _rate(rate: float | None) -> float:
    return math.inf if rate is None else float(rate)


def _twins(configs: Mapping[str, Mapping[str, Any]]) -> dict[tuple, dict[str, dict[str, str]]]:
    """Configurations grouped by everything but compression and network: key -> compression -> network -> name."""
    out: dict[tuple, dict[str, dict[str, str]]] = {}
    for name, fields in configs.items():
        key = tuple(fields.get(f) for f in _PAIR_FIELDS)
        out.setdefault(key, {}).setdefault(fields["compression"], {})[fields.get("network")] = name
    return out


def network_markdown(section: Mapping[str, Any] | None) -> str:
    """The report's "Networks" section: the fastest per network, then each codec's crossover ("" without one)."""
    if section is None:
        return ""
    lines = ["", "## Networks", "", "| network | link rate | fastest | median makespan |", "|---|---|---|---|"]
    for network, info in section["networks"].items():
        best = section["fastest"].get(network, {})
        rate = human_rate(info["rate_bit_s"]) if info["rate_bit_s"] else "unshaped"
        lines.append(
            f"| {network} | {rate} | {best.get('configuration', '-')} | {best.get('makespan_median_s', math.nan):.3f} s |"
        )
    if section["crossovers"]:
        lines += [
            "",
            "Where compression starts to pay: `t = cpu + wire/rate` fitted per configuration over the networks "
            "(unshaped = 1/rate 0), the codec pays below the rate where its line crosses the uncompressed one. "
            "CI: percentile bootstrap of that rate; *pays on slowest*: share of resamples in which the codec is "
            "faster on the slowest network.",
            "",
            "| codec | verdict | 95 % CI | pays on slowest |",
            "|---|---|---|---|",
        ]
        for c in section["crossovers"]:
            low, high = (_from_json(c[k]) for k in ("ci_low_bit_s", "ci_high_bit_s"))
            lines.append(
                f"| {c['codec']} | {c['verdict']} | {human_rate(low)} – {human_rate(high)} | {c['pays_share']:.0%} |"
            )
    return "\n".join(lines) + "\n"


def _from_json(value: float | str | None) -> float | None:
    return math.inf if value == "inf" else value  # type: ignore[return-value]
