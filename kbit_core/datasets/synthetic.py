"""Learnable synthetic image sources: handwritten-like digits (1×28×28) and coloured shapes (3×32×32).

Records are generated in fixed blocks of ``BLOCK`` samples, each from its own RNG seeded by
``(source, seed, block)``, so a record depends only on ``(seed, index)`` and never on how the
batches were requested or on ``num_records``.
"""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterator

import numpy as np

from kbit_core.datasets.base import DatasetSource
from kbit_core.datasets.glyphs import TEMPLATE_RES, digit_templates, shape_templates

BLOCK = 1024
WARP_SLICE = 128


class SyntheticSource(DatasetSource):
    """Shared block generation and caching; subclasses draw one block from a seeded RNG."""

    def __init__(self, num_records: int, seed: int = 0) -> None:
        if num_records < 1:
            raise ValueError(f"{self.name}: num_records must be >= 1, got {num_records}")
        self.num_records = num_records
        self.seed = seed
        self._stream = zlib.crc32(self.name.encode())
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def _chunks(self, start: int, stop: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo in range(start, stop, batch_size):
            yield self._read(lo, min(lo + batch_size, stop))

    def _read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for block_no in range(start // BLOCK, (stop - 1) // BLOCK + 1):
            block_images, block_labels = self._block(block_no)
            lo = max(start - block_no * BLOCK, 0)
            hi = min(stop - block_no * BLOCK, BLOCK)
            images.append(block_images[lo:hi])
            labels.append(block_labels[lo:hi])
        return np.concatenate(images), np.concatenate(labels)

    def _block(self, block_no: int) -> tuple[np.ndarray, np.ndarray]:
        # One cached block makes batch sizes that are not multiples of BLOCK cost no regeneration.
        if self._cached is None or self._cached[0] != block_no:
            rng = np.random.default_rng([self._stream, self.seed % 2**64, block_no])
            images, labels = self._generate(rng, BLOCK)
            self._cached = (block_no, images, labels)
        return self._cached[1], self._cached[2]

    @abstractmethod
    def _generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``n`` records: (images uint8[n, C, H, W], labels int64[n])."""


def _warp(
    templates: np.ndarray,
    template_ids: np.ndarray,
    rng: np.random.Generator,
    size: int,
    box: float,
    *,
    max_rotation_deg: float,
    scale: tuple[float, float],
    max_shear: float,
    max_shift_px: float,
    elastic_px: float,
) -> np.ndarray:
    """Sample each template through its own random affine + smooth elastic warp onto a size×size grid.

    ``box`` is the glyph box in output pixels (MNIST centres its digits in a 20-pixel box).
    Returns float32[n, size, size] coverage in [0, 1].
    """
    n = len(template_ids)
    angle = np.deg2rad(rng.uniform(-max_rotation_deg, max_rotation_deg, n))
    zoom = rng.uniform(*scale, n)
    aspect = rng.uniform(0.85, 1.15, n)
    shear = rng.uniform(-max_shear, max_shear, n)
    shift = rng.uniform(-max_shift_px, max_shift_px, (n, 2)) / box
    freq = rng.uniform(1.0, 3.0, (n, 2)) * np.pi
    phase = rng.uniform(0, 2 * np.pi, (n, 2))
    amp = rng.uniform(0, elastic_px, (n, 2)) / box

    # Forward map glyph -> output is rotation · (scale, aspect) · shear; sample with its inverse.
    cos, sin = np.cos(angle), np.sin(angle)
    fwd = np.empty((n, 2, 2))
    fwd[:, 0, 0] = zoom * aspect * cos
    fwd[:, 0, 1] = zoom * (aspect * cos * shear - sin / aspect)
    fwd[:, 1, 0] = zoom * aspect * sin
    fwd[:, 1, 1] = zoom * (aspect * sin * shear + cos / aspect)
    inv = (np.linalg.inv(fwd) * TEMPLATE_RES).astype(np.float32)
    shift, freq, phase, amp = (a.astype(np.float32) for a in (shift, freq, phase, amp))

    c = (((np.arange(size) + 0.5) - size / 2) / box).astype(np.float32)
    gx, gy = (g.ravel()[None, :] for g in np.meshgrid(c, c, indexing="xy"))
    centre = (TEMPLATE_RES - 1) / 2
    padded = np.pad(templates, ((0, 0), (1, 1), (1, 1))).ravel()
    out = np.empty((n, size * size), dtype=np.float32)
    # Sampling in slices that keep the temporaries in cache, each operation writing in place (the same float32
    # operations in the same order as the plain expressions, so the same bytes); all random draws happened above.
    for lo in range(0, n, WARP_SLICE):
        s = slice(lo, min(lo + WARP_SLICE, n))
        px = np.subtract(gx, shift[s, :1])
        py = np.subtract(gy, shift[s, 1:])
        wave = np.empty_like(px)
        _add_wave(px, py, freq[s, :1], phase[s, :1], amp[s, :1], wave)
        _add_wave(py, px, freq[s, 1:], phase[s, 1:], amp[s, 1:], wave)
        u = _affine(inv[s, 0], px, py, centre, wave)
        v = _affine(inv[s, 1], px, py, centre, px)  # px is not needed past here: v is written over it
        out[s] = _bilinear(padded, templates.shape[-1], template_ids[s], u, v)
    return out.reshape(n, size, size)


def _add_wave(
    target: np.ndarray, other: np.ndarray, freq: np.ndarray, phase: np.ndarray, amp: np.ndarray, scratch: np.ndarray
) -> None:
    """target += amp · sin(freq · other + phase), in place through ``scratch``."""
    np.multiply(freq, other, out=scratch)
    scratch += phase
    np.sin(scratch, out=scratch)
    scratch *= amp
    target += scratch


def _affine(row: np.ndarray, px: np.ndarray, py: np.ndarray, centre: float, out: np.ndarray) -> np.ndarray:
    """row[:, 0] · px + row[:, 1] · py + centre into ``out`` (which may be ``px``)."""
    y_term = np.multiply(row[:, 1:], py)
    np.multiply(row[:, :1], px, out=out)
    out += y_term
    out += centre
    return out


def _bilinear(padded: np.ndarray, res: int, template_ids: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Bilinear lookup of templates[id] at (u, v) template pixel coordinates, outside reading as 0; ``padded`` is the
    res×res templates with a zero border, flattened. ``u`` and ``v`` are overwritten. Returns float64 (the weights'
    precision, as the plain expression promoted them)."""
    width = res + 2
    u += 1
    v += 1
    np.clip(u, 0, res, out=u)
    np.clip(v, 0, res, out=v)
    x0 = u.astype(np.int32)  # truncation is floor: u >= 0; at most res + 1, so int32 indexes exactly
    y0 = v.astype(np.int32)
    fx = np.subtract(u, x0, dtype=np.float64)
    fy = np.subtract(v, y0, dtype=np.float64)
    idx = y0
    idx *= width
    idx += x0
    idx += (template_ids * width * width).astype(np.int32)[:, None]
    top = _lerp(padded.take(idx), padded.take(idx + 1), fx)
    idx += width
    bottom = _lerp(padded.take(idx), padded.take(idx + 1), fx)
    return _lerp(top, bottom, fy, out=top)


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a · (1 - t) + b · t in float64 (t's precision), in that order of operations."""
    weight = np.subtract(1, t)
    b_term = np.multiply(b, t)
    out = np.multiply(a, weight, out=out)
    out += b_term
    return out


def _to_uint8(x: np.ndarray) -> np.ndarray:
    """x (float32 in about [0, 1]) to uint8 pixels, rounded; x is overwritten."""
    np.clip(x, 0, 1, out=x)
    x *= 255
    return np.rint(x, out=x).astype(np.uint8)


class SyntheticDigits(SyntheticSource):
    """MNIST-like digits: pen-stroke glyphs (1–2 styles, 3 pen widths) with random affine and elastic jitter,
    uneven ink, stroke noise and sparse background speckle, on a mostly zero background like MNIST."""

    name = "synthetic_digits"
    image_shape = (1, 28, 28)
    num_classes = 10

    def _generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        templates, first, count = digit_templates()
        labels = rng.integers(0, self.num_classes, n)
        template_ids = first[labels] + (rng.random(n) * count[labels]).astype(np.int64)
        ink = _warp(
            templates,
            template_ids,
            rng,
            28,
            20.0,
            max_rotation_deg=15,
            scale=(0.8, 1.1),
            max_shear=0.3,
            max_shift_px=2.5,
            elastic_px=1.2,
        )
        strength = rng.uniform(0.6, 1.0, (n, 1, 1)).astype(np.float32)
        grain = rng.standard_normal(ink.shape, dtype=np.float32)
        grain *= 0.15
        # 1 % of pixels get a speckle of uniform brightness: r < 0.01 makes 100 r uniform on [0, 1).
        speckle = rng.random(ink.shape, dtype=np.float32)
        dark = speckle >= 0.01
        speckle *= 100
        speckle[dark] = 0
        # image = ink · (strength + grain) + speckle, written over ink
        grain += strength
        ink *= grain
        ink += speckle
        return _to_uint8(ink)[:, None], labels


class SyntheticColor(SyntheticSource):
    """Ten filled shapes in random colours on random gradient backgrounds with jitter and noise.

    The colour carries no class information, so a model has to learn the shape.
    """

    name = "synthetic_color"
    image_shape = (3, 32, 32)
    num_classes = 10

    def _generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, self.num_classes, n)
        alpha = _warp(
            shape_templates(),
            labels,
            rng,
            32,
            24.0,
            max_rotation_deg=15,
            scale=(0.6, 1.05),
            max_shear=0.2,
            max_shift_px=4.0,
            elastic_px=1.0,
        )[:, None]
        background = rng.random((n, 3, 1, 1)).astype(np.float32)
        # Each channel of the foreground differs from the background by 0.3-0.7 (circularly): always visible.
        foreground = (background + rng.uniform(0.3, 0.7, (n, 3, 1, 1)).astype(np.float32)) % 1.0
        ramp = np.linspace(-0.5, 0.5, 32, dtype=np.float32)
        tilt = rng.uniform(-0.25, 0.25, (n, 2, 1, 1)).astype(np.float32)
        gradient = tilt[:, :1] * ramp[None, None, :, None] + tilt[:, 1:] * ramp[None, None, None, :]
        noise = rng.standard_normal((n, 3, 32, 32), dtype=np.float32) * 0.05
        image = (background + gradient) * (1 - alpha) + foreground * alpha + noise
        return _to_uint8(image), labels
