"""A dependency-free line chart written as PNG (the loss curve of `moestream train-demo`).

Owns rasterising a few (x, y) series onto a white canvas with axes, grid lines and numeric tick labels in a
3x5 bitmap font, and encoding it as PNG with zlib. matplotlib is not a dependency, so this is all there is.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# 3x5 glyphs, rows top to bottom, 3 bits each (MSB = left column)
GLYPHS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2), "k": (4, 5, 6, 5, 5), "-": (0, 0, 7, 0, 0),
}
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def _text(img: np.ndarray, x: int, y: int, s: str, scale: int = 2) -> None:
    for ch in s:
        rows = GLYPHS.get(ch)
        if rows is not None:
            for r, bits in enumerate(rows):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        img[y + r * scale: y + (r + 1) * scale, x + c * scale: x + (c + 1) * scale] = 0
        x += 4 * scale


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 2) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for t in np.linspace(0.0, 1.0, n + 1):
        x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
        img[max(0, y - width // 2): y + (width + 1) // 2, max(0, x - width // 2): x + (width + 1) // 2] = color


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    raw = (hi - lo) / n
    mag = 10 ** np.floor(np.log10(raw)) if raw > 0 else 1.0
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw) if raw > 0 else 1.0
    first = np.ceil(lo / step) * step
    return [float(v) for v in np.arange(first, hi + step * 1e-9, step)]


def _label(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


def line_chart(series: list[list[tuple[float, float]]], path: Path, width: int = 800, height: int = 480) -> None:
    """Draw each series (list of (x, y)) in its own colour; axes fit all points."""
    pts = [p for s in series for p in s]
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 70, width - 20, 20, height - 40
    if pts:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        pad = (y1 - y0) * 0.05
        y0, y1 = y0 - pad, y1 + pad

        def px(x: float, y: float) -> tuple[float, float]:
            return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

        for v in _ticks(y0, y1):
            _, y = px(x0, v)
            img[int(y), left:right] = 225
            _text(img, 8, int(y) - 5, _label(v))
        for v in _ticks(x0, x1):
            x, _ = px(v, y0)
            img[top:bottom, int(x)] = 225
            _text(img, int(x) - 10, bottom + 10, _label(v))
        for color, s in zip(COLORS, series):
            for (a, b), (c, d) in zip(s, s[1:]):
                _line(img, *px(a, b), *px(c, d), color)
            if len(s) == 1:
                _line(img, *px(*s[0]), *px(*s[0]), color, width=5)
    img[top:bottom, left] = 0
    img[bottom, left:right] = 0
    write_png(img, path)


def write_png(img: np.ndarray, path: Path) -> None:
    """RGB uint8 [H, W, 3] -> PNG file."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))  # filter type 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)
