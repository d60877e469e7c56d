"""Glyph templates for the synthetic sources: pen-stroke digits and filled shapes, rendered once at 64×64.

Coordinates are in a unit glyph box, x to the right and y downwards. Every template keeps a blank
margin so that warped samples that fall outside it read as background.
"""

from __future__ import annotations

from functools import cache

import numpy as np

TEMPLATE_RES = 64
STROKE_RADII = (0.05, 0.065, 0.08)
"""Pen half-widths in glyph units: about 2 to 3 px full width when the glyph box is 20 px."""

Polyline = np.ndarray  # float[k, 2]


def _arc(cx: float, cy: float, rx: float, ry: float, deg0: float, deg1: float, n: int = 24) -> Polyline:
    a = np.deg2rad(np.linspace(deg0, deg1, n))
    return np.stack([cx + rx * np.cos(a), cy + ry * np.sin(a)], axis=1)


def _curve(p0: tuple[float, float], p1: tuple[float, float], p2: tuple[float, float], n: int = 16) -> Polyline:
    """Quadratic Bézier from p0 to p2 pulled towards p1."""
    t = np.linspace(0.0, 1.0, n)[:, None]
    a, b, c = (np.asarray(p, dtype=np.float64) for p in (p0, p1, p2))
    return (1 - t) ** 2 * a + 2 * (1 - t) * t * b + t**2 * c


def _line(*points: tuple[float, float]) -> Polyline:
    return np.asarray(points, dtype=np.float64)


# Each digit has one or two styles; a style is a list of pen strokes (polylines).
DIGIT_STYLES: tuple[tuple[list[Polyline], ...], ...] = (
    (
        [_arc(0.5, 0.5, 0.26, 0.38, 0, 360, 48)],
        [_arc(0.5, 0.5, 0.2, 0.38, 0, 360, 48), _line((0.36, 0.7), (0.64, 0.3))],
    ),
    (
        [_line((0.36, 0.26), (0.52, 0.12), (0.52, 0.88))],
        [_line((0.38, 0.24), (0.5, 0.12), (0.5, 0.88)), _line((0.34, 0.88), (0.66, 0.88))],
    ),
    (
        [np.vstack([_arc(0.5, 0.33, 0.24, 0.21, -170, 30), _line((0.25, 0.88), (0.8, 0.88))])],
        [
            np.vstack(
                [
                    _arc(0.48, 0.32, 0.22, 0.2, -160, 20),
                    _curve((0.68, 0.4), (0.4, 0.7), (0.24, 0.86)),
                    _curve((0.24, 0.86), (0.5, 0.78), (0.8, 0.88)),
                ]
            )
        ],
    ),
    (
        [_arc(0.5, 0.3, 0.22, 0.18, -150, 90), _arc(0.5, 0.68, 0.25, 0.2, -90, 150)],
        [_line((0.26, 0.12), (0.72, 0.12), (0.46, 0.44)), _arc(0.5, 0.66, 0.25, 0.22, -100, 150)],
    ),
    (
        [_line((0.62, 0.88), (0.62, 0.12), (0.2, 0.65), (0.8, 0.65))],
        [_line((0.3, 0.12), (0.25, 0.6), (0.8, 0.6)), _line((0.65, 0.3), (0.65, 0.88))],
    ),
    ([np.vstack([_line((0.72, 0.12), (0.32, 0.12), (0.3, 0.45)), _arc(0.5, 0.64, 0.24, 0.22, -120, 150)])],),
    (
        [_curve((0.68, 0.12), (0.3, 0.3), (0.28, 0.66)), _arc(0.5, 0.66, 0.22, 0.2, 0, 360, 40)],
        [_line((0.66, 0.12), (0.32, 0.58)), _arc(0.5, 0.67, 0.2, 0.2, 0, 360, 40)],
    ),
    (
        [_line((0.22, 0.14), (0.78, 0.14), (0.4, 0.88))],
        [_line((0.22, 0.14), (0.78, 0.14), (0.42, 0.88)), _line((0.35, 0.5), (0.7, 0.5))],
    ),
    ([_arc(0.5, 0.3, 0.19, 0.17, 0, 360, 40), _arc(0.5, 0.68, 0.24, 0.2, 0, 360, 40)],),
    (
        [_arc(0.5, 0.34, 0.22, 0.2, 0, 360, 40), _line((0.72, 0.34), (0.66, 0.88))],
        [_arc(0.5, 0.34, 0.22, 0.2, 0, 360, 40), _curve((0.72, 0.36), (0.72, 0.8), (0.4, 0.88))],
    ),
)


def _grid(res: int) -> tuple[np.ndarray, np.ndarray]:
    c = (np.arange(res) + 0.5) / res
    return np.meshgrid(c, c, indexing="xy")  # x varies along columns, y along rows


def _stroke_distance(strokes: list[Polyline], res: int) -> np.ndarray:
    """Distance from every template pixel centre to the nearest pen segment."""
    x, y = _grid(res)
    p = np.stack([x.ravel(), y.ravel()], axis=1)[:, None, :]
    a = np.vstack([s[:-1] for s in strokes])[None]
    b = np.vstack([s[1:] for s in strokes])[None]
    ab = b - a
    t = np.clip(((p - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12), 0.0, 1.0)
    d = np.linalg.norm(p - (a + t[..., None] * ab), axis=-1).min(axis=1)
    return d.reshape(res, res)


@cache
def digit_templates() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Anti-aliased ink coverage for every (digit, style, pen width).

    Returns:
        (templates float32[K, 64, 64] in [0, 1], first template id per digit int64[10],
        number of templates per digit int64[10]).
    """
    edge = 1.0 / TEMPLATE_RES
    out, first, count = [], [], []
    for styles in DIGIT_STYLES:
        first.append(len(out))
        for strokes in styles:
            d = _stroke_distance(strokes, TEMPLATE_RES)
            out.extend(np.clip((r - d) / edge + 0.5, 0.0, 1.0) for r in STROKE_RADII)
        count.append(len(out) - first[-1])
    return np.stack(out).astype(np.float32), np.asarray(first), np.asarray(count)


def _convex(x: np.ndarray, y: np.ndarray, corners: list[tuple[float, float]]) -> np.ndarray:
    """Inside test for a convex polygon: the point lies on the same side of every edge."""
    left = np.ones_like(x, dtype=bool)
    right = np.ones_like(x, dtype=bool)
    for (x0, y0), (x1, y1) in zip(corners, corners[1:] + corners[:1]):
        cross = (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0)
        left &= cross >= 0
        right &= cross <= 0
    return left | right


def _ellipse(x: np.ndarray, y: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    return (x - cx) ** 2 + (y - cy) ** 2 <= r * r


def _rect(x: np.ndarray, y: np.ndarray, x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)


def _rotated_bar(x: np.ndarray, y: np.ndarray, angle_deg: float, half_len: float, half_w: float) -> np.ndarray:
    a = np.deg2rad(angle_deg)
    u = (x - 0.5) * np.cos(a) + (y - 0.5) * np.sin(a)
    v = -(x - 0.5) * np.sin(a) + (y - 0.5) * np.cos(a)
    return (np.abs(u) <= half_len) & (np.abs(v) <= half_w)


SHAPE_NAMES = ("disc", "ring", "square", "frame", "triangle", "diamond", "plus", "cross", "star", "crescent")


def _shape_mask(name: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    up = [(0.5, 0.1), (0.88, 0.76), (0.12, 0.76)]
    down = [(0.12, 0.3), (0.88, 0.3), (0.5, 0.92)]
    masks = {
        "disc": lambda: _ellipse(x, y, 0.5, 0.5, 0.36),
        "ring": lambda: _ellipse(x, y, 0.5, 0.5, 0.38) & ~_ellipse(x, y, 0.5, 0.5, 0.24),
        "square": lambda: _rect(x, y, 0.18, 0.18, 0.82, 0.82),
        "frame": lambda: _rect(x, y, 0.14, 0.14, 0.86, 0.86) & ~_rect(x, y, 0.3, 0.3, 0.7, 0.7),
        "triangle": lambda: _convex(x, y, up),
        "diamond": lambda: _convex(x, y, [(0.5, 0.1), (0.9, 0.5), (0.5, 0.9), (0.1, 0.5)]),
        "plus": lambda: _rotated_bar(x, y, 0, 0.38, 0.1) | _rotated_bar(x, y, 90, 0.38, 0.1),
        "cross": lambda: _rotated_bar(x, y, 45, 0.42, 0.09) | _rotated_bar(x, y, -45, 0.42, 0.09),
        "star": lambda: _convex(x, y, up) | _convex(x, y, down),
        "crescent": lambda: _ellipse(x, y, 0.5, 0.5, 0.38) & ~_ellipse(x, y, 0.64, 0.42, 0.3),
    }
    return masks[name]()


@cache
def shape_templates(supersample: int = 4) -> np.ndarray:
    """Anti-aliased coverage of the ten filled shapes, float32[10, 64, 64] in [0, 1] (box-filtered supersampling)."""
    res = TEMPLATE_RES * supersample
    x, y = _grid(res)
    out = []
    for name in SHAPE_NAMES:
        mask = _shape_mask(name, x, y).astype(np.float32)
        out.append(mask.reshape(TEMPLATE_RES, supersample, TEMPLATE_RES, supersample).mean(axis=(1, 3)))
    return np.stack(out)
