"""Image batches cross a loader as uint8 and are converted once on the consuming side: model_input on CPU and
to_device (the training step's copy) give the very floats the loader converted before, bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from kbit_core.data.batching import BlockRows, model_input, to_batch, to_device


def queued(convert: bool) -> BlockRows:
    rng = np.random.default_rng(5)
    rows = BlockRows(convert=convert)
    for start, size in ((0, 9), (9, 6)):
        pixels = np.arange(256, dtype=np.uint8).repeat(4)[rng.permutation(1024)[: size * 12]].reshape(size, 1, 3, 4)
        rows.push(pixels, rng.integers(0, 10, size), np.arange(start, start + size), rng.permutation(size))
    return rows


def test_uint8_batches_convert_on_the_consuming_side_to_the_same_floats():
    raw, converted = queued(convert=False), queued(convert=True)
    for size in (5, 10):
        a, b = raw.take(size), converted.take(size)
        assert a.x.dtype == torch.uint8 and b.x.dtype == torch.float32
        x = model_input(a).x
        assert x.dtype == torch.float32 and torch.equal(x.view(torch.int32), b.x.view(torch.int32))
        on_device, y = to_device(a.x, a.y, torch.device("cpu"))
        assert torch.equal(on_device.view(torch.int32), b.x.view(torch.int32)) and torch.equal(y, b.y)
        assert torch.equal(a.indices, b.indices)


def test_every_uint8_value_converts_as_the_list_layout_stores_it():
    pixels = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    expected = torch.from_numpy(pixels / np.float32(255))
    assert torch.equal(to_batch(pixels, np.zeros(1), np.zeros(1)).x, expected)
    assert torch.equal(to_device(torch.from_numpy(pixels), torch.zeros(1), torch.device("cpu"))[0], expected)
    already = to_batch(pixels, np.zeros(1), np.zeros(1))
    assert model_input(already) is already  # floats (and token ids) pass through untouched
