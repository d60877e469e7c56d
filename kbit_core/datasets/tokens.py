"""A learnable synthetic token-sequence source: uint16 token ids whose class is the motif planted in them.

Each class owns a motif of ``MOTIF_LENGTH`` distinct token ids, drawn once from ``(seed)``; a record is
``seq_len`` ids drawn uniformly from the whole vocabulary with its class's motif written at a random position.
The motif tokens also occur in every other record's background (each with probability about seq_len/vocab_size),
so no single token names the class: the model has to find the motif's tokens together. Records are generated in
blocks like the synthetic images (see ``SyntheticSource``): a record depends only on ``(seed, index)``.
"""

from __future__ import annotations

import zlib

import numpy as np

from kbit_core.datasets.synthetic import SyntheticSource
from kbit_core.errors import ConfigError

MOTIF_LENGTH = 4
MAX_VOCAB = 2**16  # ids travel as uint16


class SyntheticTokens(SyntheticSource):
    """``seq_len`` token ids in ``[0, vocab_size)`` per record (uint16), ``num_classes`` motif classes."""

    name = "synthetic_tokens"
    record_dtype = "uint16"
    num_classes = 10

    def __init__(self, num_records: int, seed: int = 0, *, seq_len: int = 32, vocab_size: int = 1000) -> None:
        if not MOTIF_LENGTH <= seq_len <= 0xFFFF:
            raise ConfigError(f"dataset.seq_len={seq_len}: {self.name} needs {MOTIF_LENGTH}..65535 tokens per record")
        if not MOTIF_LENGTH * self.num_classes <= vocab_size <= MAX_VOCAB:
            raise ConfigError(
                f"dataset.vocab_size={vocab_size}: {self.name} stores token ids as uint16, so the vocabulary holds "
                f"{MOTIF_LENGTH * self.num_classes}..{MAX_VOCAB} ids"
            )
        super().__init__(num_records, seed)
        self.image_shape = (seq_len,)
        self.vocab_size = vocab_size
        motif_rng = np.random.default_rng([zlib.crc32(b"motifs"), seed % 2**64])
        # Distinct ids across all motifs, so that a motif's tokens belong to its class alone.
        chosen = motif_rng.choice(vocab_size, MOTIF_LENGTH * self.num_classes, replace=False)
        self.motifs = chosen.reshape(self.num_classes, MOTIF_LENGTH).astype(np.uint16)

    def _generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        seq_len = self.image_shape[0]
        labels = rng.integers(0, self.num_classes, n)
        tokens = rng.integers(0, self.vocab_size, (n, seq_len), dtype=np.uint16)
        starts = rng.integers(0, seq_len - MOTIF_LENGTH + 1, n)
        columns = starts[:, None] + np.arange(MOTIF_LENGTH)
        tokens[np.arange(n)[:, None], columns] = self.motifs[labels]
        return tokens, labels
