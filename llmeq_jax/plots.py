"""PNG figures for a comparison report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers / CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from llmeq_jax.evaluate import Report  # noqa: E402


def ppl_vs_size(report: Report, path: str | Path) -> Path:
    """Perplexity against parameter bytes, one labelled point per recipe."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report.rows:
        if r.ppl is None or r.param_bytes is None:
            continue
        ax.scatter(r.param_bytes / 1e6, r.ppl)
        ax.annotate(r.recipe, (r.param_bytes / 1e6, r.ppl), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("parameter bytes as stored (MB)")
    ax.set_ylabel(f"perplexity (seq {report.seq_len}, {report.n_windows} windows)")
    ax.set_title(f"{report.model}: perplexity vs size")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def weight_histograms(values: dict[str, np.ndarray], layer: str, path: str | Path) -> Path:
    """Histogram of one layer's weights per recipe (float values, or the integer grid values)."""
    n = max(len(values), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), squeeze=False)
    for ax, (name, v) in zip(axes[0], values.items()):
        v = np.asarray(v).ravel()
        integer = np.issubdtype(v.dtype, np.integer)
        lo, hi = (int(v.min()), int(v.max())) if integer else (0, 0)  # python ints: no int8 overflow
        bins = np.arange(lo - 0.5, hi + 1.5) if integer and hi - lo < 300 else 100
        ax.hist(v, bins=bins, color="tab:blue")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("integer value" if integer else "weight value", fontsize=8)
    fig.suptitle(f"quantized weight distribution: {layer}", fontsize=9)
    return _save(fig, path)


def time_breakdown(report: Report, path: str | Path) -> Path:
    """Stacked bars of load / calibrate / quantize / evaluate seconds per recipe."""
    parts = [("load_s", "load"), ("calib_s", "calibrate"), ("quantize_s", "quantize"), ("eval_s", "evaluate")]
    names = [r.recipe for r in report.rows]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names)), 4))
    bottom = np.zeros(len(names))
    for attr, label in parts:
        vals = np.array([getattr(r, attr) or 0.0 for r in report.rows])
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_ylabel("seconds")
    ax.set_title("time breakdown")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
