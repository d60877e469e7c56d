"""BlockRows: exact-size batches gathered across blocks in each block's order, equal to permuting, concatenating and
converting the rows (the assembly it replaced), for images, token ids and float pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kbit_core.data.batching import BlockRows


def blocks(dtype: str, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    made, start = [], 0
    for size in (7, 1, 12, 5):
        if dtype == "float32":
            pixels = rng.random((size, 1, 2, 3), dtype=np.float32)
        else:
            pixels = rng.integers(0, np.iinfo(dtype).max, (size, 1, 2, 3), dtype=dtype)
        made.append((pixels, rng.integers(0, 10, size), np.arange(start, start + size)))
        start += size
    return made


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_batches_are_the_rows_in_each_blocks_order_across_block_boundaries(dtype: str):
    rng = np.random.default_rng(3)
    made = blocks(dtype, rng)
    orders = [rng.permutation(7), slice(2, None), rng.permutation(12)[:9], slice(None)]
    skips = [3, 0, 0, 0]
    rows, expected = BlockRows(), []
    for (pixels, labels, indices), order, skip in zip(made, orders, skips):
        if dtype != "uint8":  # a strided view: queued contiguous once
            pixels = np.repeat(pixels, 2, axis=0)[::2]
        assert rows.push(pixels, labels, indices, order, skip) == skip
        expected += [(p, lab, i) for p, lab, i in zip(*(col[order][skip:] for col in (pixels, labels, indices)))]
    sizes = [4, 5, 3, 4]
    assert rows.size == sum(sizes) + 2
    at = 0
    for size in sizes:
        batch = rows.take(size)
        want = expected[at : at + size]
        at += size
        pixels = np.stack([p for p, _, _ in want])
        x = pixels / np.float32(255) if dtype == "uint8" else pixels.astype(np.int64 if dtype == "uint16" else "f4")
        assert batch.x.dtype == (torch.int64 if dtype == "uint16" else torch.float32)
        assert torch.equal(batch.x, torch.from_numpy(np.asarray(x)))
        assert batch.y.tolist() == [lab for _, lab, _ in want] and batch.indices.tolist() == [i for _, _, i in want]
    assert [a.tolist() for a in rows.take_arrays(2)[1:]] == [
        [lab for _, lab, _ in expected[at:]],
        [i for *_, i in expected[at:]],
    ]
    assert rows.size == 0
