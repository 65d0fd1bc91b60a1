"""Charts drawn with matplotlib (the optional `plot` extra): the train-demo loss curve and the bench run plot.

Owns importing matplotlib headless (Agg) and a clear MoestreamError naming the extra when it is not installed;
callers decide whether a missing plot is an error (`bench --plot`) or a note (train-demo keeps training).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.errors import MoestreamError

COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), or a MoestreamError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoestreamError("plots need matplotlib: pip install 'moestream[plot]'") from None
    return plt


def line_chart(series: list[list[tuple[float, float]]], path: Path, width: int = 800, height: int = 480,
               labels: list[str] | None = None, xlabel: str = "", ylabel: str = "") -> None:
    """Each series (a list of (x, y)) in its own colour, a single point as a dot; `width` x `height` pixels."""
    plt = pyplot()
    dpi = 100
    fig, ax = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    for i, s in enumerate(series):
        xs, ys = [p[0] for p in s], [p[1] for p in s]
        label = labels[i] if labels and i < len(labels) else None
        ax.plot(xs, ys, color=COLORS[i % len(COLORS)], marker="o" if len(s) == 1 else None, label=label)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if labels:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
