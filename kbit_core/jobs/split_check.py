"""Whether a ratio split of a map-style dataset gives validation and test the training split's classes: kbit
splits each partition's offsets in order, so a dataset stored sorted by class (an ImageFolder) would otherwise
validate and test on classes never trained on, and report accuracy 0 without a word."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import chi2_contingency

from kbit_core.config import KbitConfig
from kbit_core.datasets.map_style import MapStyleSource
from kbit_core.sharding import plan, split_names

# A split this unlikely to be drawn from the training split's class mix is named (a shuffled dataset's splits
# sit far above it: p is uniform on [0, 1] when the mix is the same).
FAR_OUT_P = 1e-6
# Labels read per split when the dataset keeps none to read at once (each is an item's read): evenly spaced.
MAX_ITEMS_READ = 2000
WAY_OUT = (
    "kbit splits each partition's offsets in order (shard.split_rates), so a dataset sorted by class splits by "
    "class: shuffle the dataset's order in its factory (e.g. torch.utils.data.Subset(dataset, "
    "torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()))"
)


def split_indices(cfg: KbitConfig, num_records: int) -> dict[str, np.ndarray]:
    """Split name -> the dataset indices it holds: message m (samples m*k .. m*k+k-1, k = records per message) is
    produced to partition m % P at offset m // P, and each partition's offsets are split by ``shard.split_rates``."""
    per_message, partitions = cfg.produce.variant.records_per_message, cfg.produce.partitions
    messages = math.ceil(num_records / per_message)
    counts = {p: len(range(p, messages, partitions)) for p in range(partitions)}
    planned = plan({p: (0, n) for p, n in counts.items()}, cfg.shard.split_rates)
    out = {}
    for name in split_names(cfg.shard.split_rates):
        numbers = [o * partitions + r.partition for r in planned.splits[name] for o in range(r.start, r.stop)]
        first = np.asarray(sorted(numbers), dtype=np.int64) * per_message
        samples = (first[:, None] + np.arange(per_message)).ravel()
        out[name] = samples[samples < num_records]
    return out


def split_label_mismatch(cfg: KbitConfig, source: MapStyleSource) -> str | None:
    """One line naming the splits holding classes the training split lacks, else the first whose class mix is far
    from the training split's (chi-square test), with the way out; None when the splits look alike."""
    splits = split_indices(cfg, source.num_records)
    if len(splits) < 2:
        return None
    counts = {name: np.bincount(_labels(source, idx), minlength=source.num_classes) for name, idx in splits.items()}
    train = counts["train"]
    unseen = {name: np.flatnonzero((counts[name] > 0) & (train == 0)) for name in list(splits)[1:]}
    named = [
        f"the {n} split holds {int(counts[n][c].sum())} records of classes {c.tolist()[:10]}"
        for n, c in unseen.items()
        if c.size
    ]
    if named:
        return (
            f"shard.split_rates={cfg.shard.split_rates}: {', '.join(named)} that the train split has none of; {WAY_OUT}"
        )
    for name in list(splits)[1:]:
        table = np.stack([train, counts[name]])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] > 1 and (p := float(chi2_contingency(table).pvalue)) < FAR_OUT_P:
            return (
                f"shard.split_rates={cfg.shard.split_rates}: the {name} split's class mix is far from the train "
                f"split's (chi-square p = {p:.1e}); {WAY_OUT}"
            )
    return None


def _labels(source: MapStyleSource, indices: np.ndarray) -> np.ndarray:
    """The labels of ``indices``, or of MAX_ITEMS_READ evenly spaced ones where each must be read as an item."""
    if source.kept_labels() is None and len(indices) > MAX_ITEMS_READ:
        indices = indices[np.linspace(0, len(indices) - 1, MAX_ITEMS_READ).astype(np.int64)]
    return source.labels_at(indices)
