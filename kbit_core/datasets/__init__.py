"""Dataset sources: lazily generated or read images or token sequences with labels, addressed by record index."""

from __future__ import annotations

from pathlib import Path

from kbit_core.config import DatasetConfig
from kbit_core.datasets.base import DatasetSource, Samples
from kbit_core.datasets.idx import IdxFormatError, IdxSource
from kbit_core.datasets.map_style import open_map_source
from kbit_core.datasets.synthetic import SyntheticColor, SyntheticDigits
from kbit_core.datasets.tokens import SyntheticTokens
from kbit_core.errors import ConfigError

__all__ = ["DatasetSource", "IdxFormatError", "Samples", "open_source", "source_names"]

_SYNTHETIC = {cls.name: cls for cls in (SyntheticDigits, SyntheticColor)}
_IDX = ("mnist", "fashion_mnist")
_MAP_STYLE = ("torch", "arrays")


def source_names() -> tuple[str, ...]:
    return (*_SYNTHETIC, SyntheticTokens.name, *_IDX, *_MAP_STYLE)


def open_source(cfg: DatasetConfig, *, exact: bool = False) -> DatasetSource:
    """Open the dataset that ``cfg`` describes.

    Synthetic sources generate ``cfg.num_records`` records from ``cfg.seed`` (token sequences of ``cfg.seq_len``
    ids below ``cfg.vocab_size``); IDX sources read ``cfg.path`` (``cfg.split``), capped at ``cfg.num_records``
    when it is set; map-style ones (a torch Dataset from ``cfg.factory``, arrays at ``cfg.path``) likewise, their
    float images kept as they are with ``exact`` (training straight from the dataset) instead of rounded to the 8
    bits Kafka carries.
    """
    if cfg.name in _MAP_STYLE:
        return open_map_source(cfg, exact=exact)
    if cfg.name in _SYNTHETIC or cfg.name == SyntheticTokens.name:
        if cfg.num_records is None:
            raise ConfigError(f"dataset {cfg.name!r} is generated and needs dataset.num_records")
        if cfg.name == SyntheticTokens.name:
            return SyntheticTokens(cfg.num_records, cfg.seed, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
        return _SYNTHETIC[cfg.name](cfg.num_records, cfg.seed)
    if cfg.name in _IDX:
        assert cfg.path is not None  # DatasetConfig refuses IDX datasets without a path
        return IdxSource(cfg.name, Path(cfg.path).expanduser(), cfg.split, cfg.num_records)
    raise ConfigError(f"unknown dataset {cfg.name!r}; known: {', '.join(source_names())}")
