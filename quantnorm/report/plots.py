"""PNG plots for reports. Each function is pure: data in, one PNG written atomically, path out.

Figures are built on matplotlib's object API with the Agg canvas (never pyplot), so plotting
holds no global state, needs no display and is safe to call from any thread or test.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..fileio import atomic_path
from ..measure.outliers import MASSIVE_ABS, MASSIVE_RATIO
from ..measure.sessions import CPU
from ..measure.sqnr import spearman

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_DPI = 120
_PNG_METADATA = {"Software": None}


def _figure(**kwargs) -> Figure:
    """A matplotlib Figure; matplotlib is imported on the first plot (~0.4 s that every start of
    the CLI would otherwise pay, most of them drawing nothing)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save(fig: Figure, out_png: Path) -> Path:
    """Draw ``fig`` on the Agg canvas and write it to ``out_png`` atomically, byte-reproducibly."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out_png = Path(out_png)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        # No Software tag (matplotlib's version) and no timestamp: the same numbers give the same
        # bytes, so committed plots can be checked by regenerating them.
        fig.savefig(tmp, format="png", dpi=_DPI, metadata=_PNG_METADATA)
    return out_png


def plot_layer_outliers(residual_rows: list[dict], out_png: Path, title: str) -> Path:
    """Per residual layer: max |a| and median |a| (log y, left), max/median ratio (log y, right).

    Dashed lines mark Sun et al.'s massive-activation thresholds (|a| > 100, ratio >= 1000), so a
    tiny model's distance from them is visible at a glance.
    """
    if not residual_rows:
        raise ValueError("no residual rows to plot")
    labels = [str(r["layer"]) for r in residual_rows]
    x = np.arange(len(labels))
    max_abs = np.array([abs(r["top"][0]["value"]) if r.get("top") else np.nan for r in residual_rows])
    median = np.array([r["median_abs"] for r in residual_rows], dtype=float)
    ratio = np.array([np.nan if r.get("ratio") is None else r["ratio"] for r in residual_rows], dtype=float)

    fig = _figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(x, max_abs, "o-", color="tab:red", label="max |a|")
    ax.plot(x, median, "s-", color="tab:blue", label="median |a|")
    ax.axhline(MASSIVE_ABS, color="tab:red", linestyle=":", linewidth=1, label=f"|a| = {MASSIVE_ABS:g}")
    ax.set_yscale("log")
    ax.set_xticks(x, labels)
    ax.set_xlabel("residual stream after layer")
    ax.set_ylabel("|activation|")

    ax2 = ax.twinx()
    ax2.plot(x, ratio, "^--", color="tab:green", label="max / median")
    ax2.axhline(MASSIVE_RATIO, color="tab:green", linestyle=":", linewidth=1, label=f"ratio = {MASSIVE_RATIO:g}")
    ax2.set_yscale("log")
    ax2.set_ylabel("max / median ratio")

    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="best")
    ax.set_title(title)
    return save(fig, out_png)


def plot_activation_heatmap(matrix: np.ndarray, out_png: Path, title: str) -> Path:
    """|a| over (position, channel) of one sample at one layer, log colour scale."""
    from matplotlib.colors import LogNorm

    a = np.abs(np.asarray(matrix, dtype=float))
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"heatmap needs a [positions, channels] matrix, got shape {a.shape}")
    positive = a[a > 0]
    vmax = float(a.max()) if positive.size else 1.0
    # Zeros have no log: floor the scale at the smallest non-zero value (or 1e-6 of the max).
    vmin = max(float(positive.min()), vmax * 1e-6) if positive.size else vmax * 1e-6
    fig = _figure(figsize=(8, 4))
    ax = fig.add_subplot()
    image = ax.imshow(np.clip(a, vmin, None), aspect="auto", interpolation="nearest", origin="upper",
                      cmap="viridis", norm=LogNorm(vmin=vmin, vmax=max(vmax, vmin * 10)))
    fig.colorbar(image, ax=ax, label="|activation|")
    p, c = np.unravel_index(int(np.argmax(a)), a.shape)
    ax.set_xlabel("channel")
    ax.set_ylabel("token position")
    ax.set_title(f"{title}\nmax |a| = {a[p, c]:.3g} at position {p}, channel {c}", fontsize=10)
    return save(fig, out_png)


def plot_sqnr_vs_outlier(rows: list[dict], out_png: Path, title: str) -> Path:
    """Scatter of each tensor's max/median ratio (log x) against its SQNR (dB).

    ``rows`` need "ratio" and "sqnr_db" (e.g. ``sqnr_summary``'s join, or sqnr rows merged with
    ``onnx_tensor_stats``); rows missing either are skipped. The five worst tensors are labelled.
    """
    points = [r for r in rows if r.get("ratio") is not None and r.get("sqnr_db") is not None]
    fig = _figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    if points:
        ratio = np.array([r["ratio"] for r in points], dtype=float)
        sqnr = np.array([r["sqnr_db"] for r in points], dtype=float)
        ax.scatter(ratio, sqnr, s=18, alpha=0.8)
        for r in sorted(points, key=lambda r: r["sqnr_db"])[:5]:
            ax.annotate(str(r.get("tensor", "")), (r["ratio"], r["sqnr_db"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
    rho = spearman([r["ratio"] for r in points], [r["sqnr_db"] for r in points])
    rho_text = "n/a" if rho is None else f"{rho:+.2f}"
    ax.set_xlabel("max |a| / median |a| (log)")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"{title}\nSpearman rho = {rho_text}, {len(points)} tensors", fontsize=10)
    ax.grid(True, alpha=0.3)
    return save(fig, out_png)


def plot_recipe_tradeoff(recipes: list[dict], latency_rows: list[dict], out_png: Path, title: str) -> Path:
    """Per recipe: PPL ratio (left bars) and CPU p50 latency relative to FP32 at the largest
    measured batch (right bars). ``recipes`` are results.json recipe entries with accuracy."""
    cpu = [r for r in latency_rows if r.get("status") == "measured" and r["provider"] == CPU]
    batch = max((r["batch"] for r in cpu), default=None)
    p50 = {r["variant"]: r["p50_ms"] for r in cpu if r["batch"] == batch}
    names = [r["name"] for r in recipes]
    ratios = [r["accuracy"]["ppl_ratio"] for r in recipes]
    speed = [p50[n] / p50["fp32"] if n in p50 and "fp32" in p50 else np.nan for n in names]

    fig = _figure(figsize=(9, 0.5 * len(names) + 2))
    ax_acc, ax_lat = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(names))
    ax_acc.barh(y, ratios, color="tab:red")
    ax_acc.axvline(1.0, color="black", lw=0.8)
    ax_acc.set_xlim(min(1.0, min(ratios)) - 0.002, max(ratios) + 0.005)
    ax_acc.set_yticks(y, names, fontsize=8)
    ax_acc.set_xlabel("PPL(int8) / PPL(fp32)")
    ax_lat.barh(y, speed, color="tab:blue")
    ax_lat.axvline(1.0, color="black", lw=0.8)
    ax_lat.set_xlabel(f"p50 latency vs FP32 (CPU, batch {batch})")
    fig.suptitle(title)
    return save(fig, out_png)


def plot_interval_series(labels: list[str], series: dict[str, list[tuple]], out_png: Path, title: str, ylabel: str,
                         reference: float | None = None) -> Path:
    """Per setting (x), one marker per series with its interval as an error bar.

    ``series`` maps a name to one ``(mean, lo, hi)`` per label; None values are left out (a
    mean without an interval is drawn without a bar). ``reference`` draws a horizontal line.
    """
    if not labels:
        raise ValueError("no settings to plot")
    fig = _figure(figsize=(max(6.0, 0.55 * len(labels) + 2), 4.5))
    ax = fig.add_subplot()
    x = np.arange(len(labels), dtype=float)
    k = max(1, len(series))
    width = 0.7 / k
    for i, (name, points) in enumerate(series.items()):
        xs = x - 0.35 + width * (i + 0.5)
        mean = np.array([np.nan if p[0] is None else p[0] for p in points], dtype=float)
        lo = np.array([np.nan if p[1] is None else p[1] for p in points], dtype=float)
        hi = np.array([np.nan if p[2] is None else p[2] for p in points], dtype=float)
        err = np.vstack([np.where(np.isnan(lo), 0.0, mean - lo), np.where(np.isnan(hi), 0.0, hi - mean)])
        err = np.where(np.isnan(err), 0.0, err)
        ax.errorbar(xs, mean, yerr=err, fmt="o", capsize=3, label=name, markersize=4)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8)
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7, loc="best")
    return save(fig, out_png)


def plot_layer_series(series: dict[str, tuple[list[str], list[tuple]]], out_png: Path, title: str, ylabel: str,
                      log: bool = True, styles: dict[str, dict] | None = None) -> Path:
    """One line per setting over layers (``(layer labels, [(mean, lo, hi), ...])``) with error bars.

    ``styles`` optionally gives matplotlib line keywords per series (e.g. colour by placement,
    line style by norm)."""
    if not series:
        raise ValueError("no series to plot")
    fig = _figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    all_layers: list[str] = []
    for layers, _ in series.values():
        for lab in layers:
            if lab not in all_layers:
                all_layers.append(lab)
    pos = {lab: i for i, lab in enumerate(all_layers)}
    for name, (layers, points) in series.items():
        xs = np.array([pos[lab] for lab in layers], dtype=float)
        mean = np.array([np.nan if p[0] is None else p[0] for p in points], dtype=float)
        lo = np.array([np.nan if p[1] is None else p[1] for p in points], dtype=float)
        hi = np.array([np.nan if p[2] is None else p[2] for p in points], dtype=float)
        err = np.vstack([np.where(np.isnan(lo), 0.0, mean - lo), np.where(np.isnan(hi), 0.0, hi - mean)])
        err = np.where(np.isnan(err), 0.0, err)
        style = {"marker": "o", "linestyle": "-", **((styles or {}).get(name) or {})}
        ax.errorbar(xs, mean, yerr=err, capsize=3, label=name, markersize=3, linewidth=1, **style)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(np.arange(len(all_layers)), all_layers)
    ax.set_xlabel("residual stream after layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2)
    return save(fig, out_png)


def plot_depth_series(series: dict[str, tuple[list[int], list[tuple]]], depths: list[int], out_png: Path,
                      title: str, ylabel: str) -> Path | None:
    """One line per setting over depth (log-log), ``(depths, [(mean, lo, hi), ...])`` each, with
    error bars (none where the interval is missing). None, and no file, when no series has a point."""
    from matplotlib.ticker import NullLocator

    fig = _figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for label, (xs, points) in series.items():
        if not xs:
            continue
        mean = [m for m, _, _ in points]
        err_lo = [m - lo if lo is not None and hi is not None else 0.0 for m, lo, hi in points]
        err_hi = [hi - m if lo is not None and hi is not None else 0.0 for m, lo, hi in points]
        ax.errorbar(xs, mean, yerr=[err_lo, err_hi], marker="o", capsize=3, linewidth=1, markersize=3, label=label)
        drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("depth (blocks)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2)
    return save(fig, out_png)


def plot_token_latency(series: dict[str, list[float]], out_png: Path, title: str, *, start: int = 0) -> Path:
    """Per-token decode latency (ms) against the position of the token, one line per model:
    the cache grows with the position, so a line that climbs reads a cache that costs."""
    fig = _figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for name, times in series.items():
        ax.plot(np.arange(start, start + len(times)), times, lw=1.0, label=name)
    ax.set_xlabel("position of the generated token (prompt + tokens before it)")
    ax.set_ylabel("step latency, ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title)
    return save(fig, out_png)


def plot_accuracy_speed(points: list[tuple[str, str, float, float]], front: list[str], out_png: Path, title: str, *,
                        goal_kld: float | None = None, fp32_tok_s: float | None = None) -> Path:
    """KL mean (log y) against generation tokens/s (x): ``points`` are (label, group, tokens/s, KL),
    one colour per group (quantnorm, each engine), each point labelled. The accuracy goal's KL is a
    horizontal line, FP32's speed a vertical one, the Pareto front (the ``front`` labels) joined.
    A KL of 0 (an engine's own float model can match exactly) is drawn at the axis' floor."""
    if not points:
        raise ValueError("no points to plot")
    positive = [kl for *_, kl in points if kl > 0]
    floor = min(positive + [goal_kld or 1.0]) / 10
    fig = _figure(figsize=(8, 5))
    ax = fig.subplots()
    groups = list(dict.fromkeys(group for _, group, _, _ in points))
    colours = {group: f"C{i}" for i, group in enumerate(groups)}
    for label, group, speed, kl in points:
        ax.scatter([speed], [max(kl, floor)], color=colours[group], zorder=3)
        ax.annotate(label, (speed, max(kl, floor)), fontsize=7, xytext=(4, 3), textcoords="offset points")
    by_label = {label: (speed, max(kl, floor)) for label, _, speed, kl in points}
    line = sorted(by_label[label] for label in front if label in by_label)
    if len(line) > 1:
        ax.plot(*zip(*line), color="black", lw=1.0, ls="-", zorder=2, label="Pareto front")
    if goal_kld:
        ax.axhline(goal_kld, color="tab:red", ls=":", lw=1.0, label=f"accuracy goal: KL {goal_kld:g}")
    if fp32_tok_s:
        ax.axvline(fp32_tok_s, color="gray", ls="--", lw=1.0, label=f"FP32: {fp32_tok_s:,.1f} tok/s")
    for group in groups:
        ax.scatter([], [], color=colours[group], label=group)
    ax.set_yscale("log")
    ax.margins(x=0.12)   # room for the labels of the rightmost points
    ax.set_xlabel("generation tokens/s (batch 1)")
    ax.set_ylabel("KL mean vs FP32, nats (log)")
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title)
    return save(fig, out_png)
