"""The loss curve of examples/train_llama.py as a PNG: drawn with matplotlib when it is installed
(as benchmarks/plot.py draws, on the Agg backend: no display on a cluster node), else as a plain
line on a white canvas by the few lines of PNG writing below, so the example needs no extra package.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 640, 360, 24


def save_loss_plot(losses: list[float], path: Path, title: str) -> str:
    """Writes the plot; returns how it was drawn ("matplotlib" or "built-in writer")."""
    try:
        import matplotlib
    except ImportError:
        _write_png(path, _line_canvas(losses))
        return "built-in writer"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(8, 4.5))
    axis.plot(range(1, len(losses) + 1), losses, color="#1f77b4", linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("loss (cross-entropy, nats per token)")
    axis.set_title(title, fontsize=9, loc="left")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return "matplotlib"


def _line_canvas(losses: list[float]) -> list[bytearray]:
    """Rows of grey levels: a frame and the curve, scaled to fill the frame (no text)."""
    rows = [bytearray(b"\xff" * WIDTH) for _ in range(HEIGHT)]
    left, right, top, bottom = MARGIN, WIDTH - MARGIN, MARGIN, HEIGHT - MARGIN
    for x in range(left, right + 1):
        rows[top][x] = rows[bottom][x] = 160
    for y in range(top, bottom + 1):
        rows[y][left] = rows[y][right] = 160
    low, high = min(losses, default=0.0), max(losses, default=1.0)
    span, steps = (high - low) or 1.0, max(len(losses) - 1, 1)
    points = [(left + round(i * (right - left) / steps), bottom - round((v - low) * (bottom - top) / span))
              for i, v in enumerate(losses)]
    for (x0, y0), (x1, y1) in zip(points, points[1:] or points):
        for t in range(max(abs(x1 - x0), abs(y1 - y0)) + 1):
            share = t / max(abs(x1 - x0), abs(y1 - y0), 1)
            rows[round(y0 + share * (y1 - y0))][round(x0 + share * (x1 - x0))] = 0
    return rows


def _write_png(path: Path, rows: list[bytearray]) -> None:
    """An 8-bit greyscale PNG: signature, IHDR, one zlib-compressed IDAT (filter 0 per row), IEND."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", len(rows[0]), len(rows), 8, 0, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + bytes(row) for row in rows), 9)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels)
                           + chunk(b"IEND", b""))
