"""BlockRows: exact-size batches gathered across blocks in each block's order, equal to permuting, concatenating and
converting the rows (the assembly it replaced), for images, token ids and float pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kbit_core.data.batching import BlockRows, model_input, model_inputs


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


def test_a_groups_batches_taken_and_converted_together_equal_each_batch_taken_and_converted_alone():
    rng = np.random.default_rng(5)
    made = blocks("uint8", rng)
    one_by_one, together = BlockRows(convert=False), BlockRows(convert=False)
    for pixels, labels, indices in made:
        order = rng.permutation(len(labels))
        one_by_one.push(pixels, labels, indices, order, 0)
        together.push(pixels, labels, indices, order, 0)
    sizes = [4, 9, 3, 8]
    alone = [model_input(one_by_one.take(size)) for size in sizes]
    group = model_inputs(together.take_many(sizes))
    for a, b in zip(alone, group, strict=True):
        assert b.x.dtype == torch.float32 and torch.equal(a.x, b.x)
        assert torch.equal(a.y, b.y) and torch.equal(a.indices, b.indices)
    # converted in one operation: every batch views one float32 tensor
    assert len({batch.x.untyped_storage().data_ptr() for batch in group}) == 1


def test_batches_that_are_not_one_groups_views_are_converted_one_by_one():
    rng = np.random.default_rng(6)
    pixels = rng.integers(0, 255, (10, 1, 2, 3), dtype=np.uint8)
    rows = BlockRows(convert=False)
    rows.push(pixels, np.arange(10), np.arange(10), slice(None), 0)
    separate = [rows.take(4), rows.take(6)]
    partial = BlockRows(convert=False)
    partial.push(pixels, np.arange(10), np.arange(10), slice(None), 0)
    group = partial.take_many([4, 6])
    rest_of_group = group[1:]  # the group's second batch alone: not all of it
    reordered = group[::-1]  # all of it, out of order
    for batches in (separate, rest_of_group, reordered):
        converted = model_inputs(batches)
        assert [torch.equal(c.x, model_input(b).x) for c, b in zip(converted, batches, strict=True)] == [True] * len(
            batches
        )
        assert len({batch.x.untyped_storage().data_ptr() for batch in converted}) == len(batches)
