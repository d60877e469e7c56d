"""A rank's batches as tensors: the Batch type every loader yields, the block queue that gathers decoded blocks'
rows in their permuted order straight into exact-size batch tensors (in the payload's dtype, uint8 for images), and
the one conversion of a batch's pixels into the model's input (:func:`model_input`, or a group's batches at once:
:func:`model_inputs`, on the consuming thread)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class Batch(NamedTuple):
    # float32 [B, C, H, W] in [0, 1] (images), or int64 [B, L] token ids; inside a loader (between its threads and
    # processes) images stay uint8 [B, C, H, W] until model_input converts them on the consuming thread
    x: torch.Tensor
    y: torch.Tensor  # int64 [B]
    indices: torch.Tensor  # int64 [B], dataset sample indices (for audits)
    produced_ms: np.ndarray | None = None  # live stream only: each record's produce time (for freshness)


def batch_dtype(pixels: np.dtype) -> torch.dtype:
    """The dtype of a batch's x for decoded pixels of ``pixels``: uint8 images and floats as float32, token ids (uint16,
    which torch's embeddings do not index with) as int64."""
    return torch.int64 if np.issubdtype(pixels, np.integer) and pixels != np.uint8 else torch.float32


def convert_into(pixels: np.ndarray, out: np.ndarray) -> None:
    """``pixels`` into ``out`` (of :func:`batch_dtype`), a whole batch per operation: uint8 cast to float32, then
    divided by 255 in place (exactly the list layout's floats, and numpy's own uint8 / float32; a float32 division
    over contiguous memory is vectorised, the mixed-type one is not). In numpy, not torch: torch's intra-op threads
    spin against the training threads (measured 6.5 ms instead of 26 us per 64-image batch on 2 busy cores)."""
    np.copyto(out, pixels, casting="unsafe")
    if pixels.dtype == np.uint8:
        np.divide(out, np.float32(255), out=out)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's ``(x, y)`` copied to ``device`` without blocking (from page-locked memory), uint8 pixels converted
    there in one operation: 1 byte a pixel crosses instead of 4. The divisor is a tensor on the device, not a Python
    number: CUDA multiplies by the reciprocal of a scalar divisor, which is not always uint8 / 255 rounded once as
    :func:`convert_into` computes it (a float32 division is IEEE-exact on both, so the values are the same)."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    if x.dtype == torch.uint8:
        x = x.to(torch.float32).div_(torch.full((), 255.0, dtype=torch.float32, device=device))
    return x, y


def empty(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    # page-locked from the start, on the loader's thread, so the training loop's non_blocking copy to the GPU is
    # asynchronous (from pageable memory CUDA copies synchronously) and nothing is copied to pin it
    return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)


def to_batch(pixels: np.ndarray, labels: np.ndarray, indices: np.ndarray, pin_memory: bool = False) -> Batch:
    """A Batch of decoded arrays (rows in order)."""
    return model_input(raw_batch(pixels, labels, indices, pin_memory), pin_memory)


def raw_batch(pixels: np.ndarray, labels: np.ndarray, indices: np.ndarray, pin_memory: bool = False) -> Batch:
    """A Batch of decoded arrays (rows in order) as a loader passes it on: uint8 pixels kept as they are."""
    if pixels.dtype == np.uint8:
        x = empty(pixels.shape, torch.uint8, pin_memory)
        x.numpy()[...] = pixels
    else:
        x = empty(pixels.shape, batch_dtype(pixels.dtype), pin_memory)
        convert_into(pixels, x.numpy())
    y = empty(labels.shape, torch.int64, pin_memory)
    y.numpy()[...] = labels
    return Batch(x, y, torch.from_numpy(indices.astype(np.int64, copy=False)))


def model_inputs(batches: list[Batch]) -> list[Batch]:
    """:func:`model_input` of each of ``batches``. When they are :meth:`BlockRows.take_many`'s, the consecutive views
    of one batch and all of it, its pixels are converted in one operation and the batches view the result: per
    batch, the conversion's calls and allocations cost as much as its pixels at a batch of 64."""
    whole = _whole_group(batches)
    if whole is None:
        return [model_input(batch) for batch in batches]
    # numpy's allocation, not torch.empty's: a group's float32 is megabytes (12.8 for a 4,096-record block of
    # digits, 50 of 3x32x32 images), and torch's were faulted in afresh on every pass even with the reader's freed
    # memory kept (test_reader_memory's loader over three passes, 2026-12-06: 0.22 faults a record against numpy's
    # 0.009-0.020); numpy asks for huge pages from 4 MiB, so a group mapped fresh faults 2 MiB at a time. It lives
    # while any of its batches does.
    x = torch.from_numpy(np.empty(tuple(whole.shape), np.float32))
    convert_into(whole.numpy(), x.numpy())
    out, at = [], 0
    for batch in batches:
        out.append(batch._replace(x=x[at : at + len(batch.x)]))
        at += len(batch.x)
    return out


def _whole_group(batches: list[Batch]) -> torch.Tensor | None:
    """The uint8 tensor whose rows ``batches`` are, each the next rows in order and all of them together
    (:meth:`BlockRows.take_many`'s views); None for any other batches."""
    whole = batches[0].x._base if batches else None
    if whole is None or whole.dtype != torch.uint8 or not whole.is_contiguous() or not len(whole):
        return None
    expected, row_bytes = whole.data_ptr(), whole[0].nbytes
    for batch in batches:
        if batch.x._base is not whole or batch.x.data_ptr() != expected:
            return None
        expected += len(batch.x) * row_bytes
    return whole if expected == whole.data_ptr() + whole.nbytes else None


def model_input(batch: Batch, pin_memory: bool = False) -> Batch:
    """``batch`` with uint8 pixels converted to the model's float32 in one operation (:func:`convert_into`, the one
    conversion every path uses, so the values are the same bit for bit); any other ``x`` is already the model's."""
    if batch.x.dtype != torch.uint8:
        return batch
    x = empty(tuple(batch.x.shape), torch.float32, pin_memory)
    convert_into(batch.x.numpy(), x.numpy())
    return batch._replace(x=x)


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.uint8: np.uint8}


@dataclass
class _Block:
    """A decoded block's columns, and the rows still to take: ``order[at:end]`` (its permutation), or rows ``at..end``
    themselves when ``order`` is None (in order)."""

    pixels: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    order: np.ndarray | None
    at: int
    end: int

    def rows(self, k: int) -> np.ndarray | slice:
        """The next ``k`` rows to take (an index or a slice), taken."""
        at, self.at = self.at, self.at + k
        return slice(at, at + k) if self.order is None else self.order[at : at + k]


class BlockRows:
    """A FIFO of decoded blocks that hands out exact-size batches across block boundaries: each batch's rows are
    gathered from the blocks (by index, no permuted copy of a block) straight into its tensors (page-locked with
    ``pin_memory``), its pixels converted in one operation, or (``convert=False``) uint8 pixels left as they are for
    :func:`model_input` on the consuming side; the numpy calls per batch do not grow with its size."""

    def __init__(self, pin_memory: bool = False, convert: bool = True) -> None:
        self.pin_memory, self.convert = pin_memory, convert
        self._blocks: deque[_Block] = deque()
        self._staging: np.ndarray | None = None  # the rows' pixels as decoded, reused by every batch
        self.size = 0

    def push(
        self, pixels: np.ndarray, labels: np.ndarray, indices: np.ndarray, order: np.ndarray | slice, skip: int = 0
    ) -> int:
        """Queue a block's rows in ``order`` (an index: its permutation; or a slice of rows in order), past its
        first ``skip`` (a resume's); returns how many of them were skipped."""
        pixels = np.ascontiguousarray(pixels)  # np.take copies a strided array whole on every call: once here
        if isinstance(order, slice):
            start, stop, _ = order.indices(len(labels))
            block = _Block(pixels, labels, indices, None, start, max(start, stop))
        else:
            block = _Block(pixels, labels, indices, order, 0, len(order))
        skipped = min(skip, block.end - block.at)
        block.at += skipped
        if block.end > block.at:
            self._blocks.append(block)
            self.size += block.end - block.at
        return skipped

    def take_many(self, sizes: list[int]) -> list[Batch]:
        """The next batches of ``sizes``, gathered as one (numpy's calls per batch cost as much as 64 digits' rows):
        consecutive views of one batch's tensors."""
        whole = self.take(sum(sizes))
        batches, at = [], 0
        for size in sizes:
            batches.append(Batch(whole.x[at : at + size], whole.y[at : at + size], whole.indices[at : at + size]))
            at += size
        return batches

    def take(self, n: int) -> Batch:
        parts = self._parts(n)
        pixels = parts[0][0].pixels
        raw = pixels.dtype == np.uint8 and not self.convert
        x, xs = self._empty((n, *pixels.shape[1:]), torch.uint8 if raw else batch_dtype(pixels.dtype))
        y, ys = self._empty((n,), torch.int64)
        indices = np.empty(n, np.int64)
        staged = xs if xs.dtype == pixels.dtype else self._staged(n, pixels)
        at = 0
        for block, rows, k in parts:
            _gather(block.pixels, rows, staged[at : at + k])
            _gather(block.labels, rows, ys[at : at + k])
            _gather(block.indices, rows, indices[at : at + k])
            at += k
        if staged is not xs:
            convert_into(staged, xs)
        return Batch(x, y, torch.from_numpy(indices))

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """A batch tensor and its numpy view (page-locked with ``pin_memory``; else numpy's allocation, the cheaper
        one on a busy core)."""
        if self.pin_memory:
            tensor = empty(shape, dtype, pin_memory=True)
            return tensor, tensor.numpy()
        array = np.empty(shape, _NUMPY[dtype])
        return torch.from_numpy(array), array

    def take_arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``n`` rows as decoded arrays (for padding, rare)."""
        parts = self._parts(n)
        return tuple(  # type: ignore[return-value]
            np.concatenate([getattr(block, name)[rows] for block, rows, _ in parts])
            for name in ("pixels", "labels", "indices")
        )

    def _parts(self, n: int) -> list[tuple[_Block, np.ndarray | slice, int]]:
        """The blocks the next ``n`` rows come from, with their rows and how many, taken."""
        parts, need = [], n
        while need:
            block = self._blocks[0]
            k = min(need, block.end - block.at)
            parts.append((block, block.rows(k), k))
            if block.at == block.end:
                self._blocks.popleft()
            need -= k
        self.size -= n
        return parts

    def _staged(self, n: int, pixels: np.ndarray) -> np.ndarray:
        staging = self._staging
        if (
            staging is None
            or len(staging) < n
            or staging.shape[1:] != pixels.shape[1:]
            or staging.dtype != pixels.dtype
        ):
            staging = self._staging = np.empty((n, *pixels.shape[1:]), pixels.dtype)
        return staging[:n]


def _gather(column: np.ndarray, rows: np.ndarray | slice, out: np.ndarray) -> None:
    if isinstance(rows, slice) or column.dtype != out.dtype:
        out[...] = column[rows]
    else:
        np.take(column, rows, axis=0, out=out, mode="wrap")  # rows are in range; "raise" would buffer the output
