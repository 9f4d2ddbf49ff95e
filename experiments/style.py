"""How every figure of results/figures/ looks and is saved: the shared style of the figure modules.

Importing this module selects matplotlib's Agg backend (no display needed). The figure modules
(``figure2``, ``mnist_figures``, ``figure6``, ``frontier_figure``) draw with ``plt`` from here and
save with ``save``, so every PNG and PDF is byte-reproducible from its CSV.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

__all__ = [
    "COLUMN_DPI",
    "COLUMN_RC",
    "COLUMN_WIDTH_IN",
    "CONVENTION_TEXT",
    "convention",
    "fmt_delta",
    "fmt_value",
    "grid",
    "legend_below",
    "log_x",
    "plt",
    "save",
]

# Byte-reproducible files: the same CSVs give the same bytes on every run, so `make figures` leaves
# git clean. matplotlib stamps a PDF with its creation time (now, or SOURCE_DATE_EPOCH when set)
# unless the entry is None, and a PNG with a "Software" text chunk; both are left out. Everything
# else in the files (fonts subset to the glyphs used, object order) is a function of the figure
# alone; the bytes still depend on the matplotlib and FreeType builds, pinned in requirements.lock.
PDF_METADATA = {"CreationDate": None}
PNG_METADATA = {"Software": None}

# Figures 3, 4 and 6 are laid out to be read at a paper's text width (7 in: a one-column paper's
# column, a two-column paper's figure*), printed at that size: text 7-9 pt, one legend outside the
# panels.
COLUMN_WIDTH_IN = 7.0
COLUMN_DPI = 200
COLUMN_RC = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7.5,
    "ytick.labelsize": 7.5,
    "legend.fontsize": 7.5,
    "figure.titlesize": 9,
    "lines.linewidth": 1.3,
}

CONVENTION_TEXT = {
    "per_tensor": "per-tensor charges (paper's code)",
    "joint": "joint charge (σ/√k)",
}


def save(fig, out: Path, name: str, dpi: int = 130) -> list[Path]:
    """``out/name.png`` and ``out/name.pdf``, without time stamps; the figure is closed."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=dpi, bbox_inches="tight", metadata=PNG_METADATA)
    fig.savefig(paths[1], bbox_inches="tight", metadata=PDF_METADATA)
    plt.close(fig)
    return paths


def grid(n: int, ncols: int, panel_h: float, extra_h: float, **kw):
    """A column-wide figure with ``n`` panels in rows of ``ncols``; unused panels switched off."""
    nrows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(COLUMN_WIDTH_IN, panel_h * nrows + extra_h),
        squeeze=False,
        layout="constrained",
        **kw,
    )
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, axes


def legend_below(fig, axes, ncol: int) -> None:
    """One legend for the figure, below the panels: each label once, in first-drawn order."""
    seen = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    fig.legend(
        list(seen.values()), list(seen), loc="outside lower center", ncol=ncol, frameon=False
    )


def log_x(ax, ticks=(0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)) -> None:
    """Log-scale x axis with plain-number ticks (no 2×10^0 style minor labels)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, StrMethodFormatter

    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if lo <= t <= hi] or list(ticks)))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def fmt_delta(x: float) -> str:
    """δ as the paper writes it: 1e-5, 1e-4 (not 1e-05, 0.0001)."""
    mantissa, exponent = f"{float(x):e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def fmt_value(x: float) -> str:
    """A number as ``{x:g}``, infinity as ∞."""
    return "∞" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:g}"


def convention(df: pd.DataFrame) -> str:
    """The accounting conventions of the rows, in words."""
    vals = sorted(set(df["convention"].dropna())) if "convention" in df else []
    return ", ".join(CONVENTION_TEXT.get(v, v) for v in vals) or "n/a"
