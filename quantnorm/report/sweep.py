"""A sweep's cells as the sweep report reads them: :class:`CellResult` (one finished cell),
:class:`Sweep` (all of them, with the manifest and the cells left out) and their loaders.

Reads only what the cells wrote: ``<cell>/results.json`` (or ``cells/<cell>/results.json`` in a
published copy) through quantnorm.results, its ``diagnostics`` included; ``train.json`` and
``config.json`` of a cell whose training diverged; ``train_log.jsonl`` for step 0's gradient
norms; ``sweep.json`` for the commands. Training status first (quantnorm.train_status): a cell
is trained, collapsed or diverged, and every effect is computed on :meth:`Sweep.trained_view`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import results as results_file
from ..errors import DataError, RunDirError
from ..manifest import MANIFEST_FILE, read_manifest
from ..results import DEFAULT_COLLAPSE_MARGIN, DIVERGED, STATUSES, check_margin, status_from_results
from ..results import STATUS_TRAINED as TRAINED
from ..runs import CONFIG_FILE, PLOTS_DIR, RESULTS_FILE, TRAIN_LOG_FILE, TRAIN_SUMMARY_FILE
from .stats import Estimate, estimate, finite, line_fit

PLACEMENT_ORDER = ("post", "pre", "peri", "deepnorm", "residual")
NORM_ORDER = ("layer", "rms")


@dataclass
class CellResult:
    """One finished cell: its results.json (None when training diverged) and training summary.

    ``status`` (trained / collapsed / diverged, quantnorm.train_status) is set by :func:`load_cell`
    from the recorded keys or, for runs written before they existed, from the data ranges. A cell
    built in memory without it takes the recorded ``train.status``, else ``diverged`` or ``trained``.
    """

    name: str
    path: Path
    placement: str
    norm: str
    depth: int
    warmup: int
    seed: int
    diverged: bool
    train: dict
    results: dict | None = None
    grad0: dict | None = None
    perturbation: list[dict] | None = None   # results["diagnostics"]["perturbation"]
    block_cosine: list[float] | None = None  # results["diagnostics"]["block_cosine"], one per block
    status: str | None = None
    unigram: float | None = None              # bits/byte of the unigram baseline
    grad_ffn0: dict | None = None            # step 0's per-block FFN weight gradient norms (train_log.jsonl)
    lr: float | None = None                  # peak learning rate (train.config.lr)
    status_derived: bool = False             # status computed when read (the run did not record one)

    def __post_init__(self) -> None:
        if self.status is None:
            recorded = self.train.get("status")
            self.status = DIVERGED if self.diverged else (recorded if recorded in STATUSES else TRAINED)
        if self.lr is None:
            lr = (self.train.get("config") or {}).get("lr")
            self.lr = float(lr) if finite([lr]) else None

    @property
    def trained(self) -> bool:
        return self.status == TRAINED

    @property
    def group(self) -> tuple:
        return (self.placement, self.norm, self.depth, self.warmup, self.lr)

    @property
    def bits_per_byte(self) -> float | None:
        return None if self.diverged else self.train.get("eval_bits_per_byte")

    def recipe_names(self) -> list[str]:
        return [r.name for r in results_file.recipes(self.results)]

    def recipe(self, name: str) -> results_file.Recipe | None:
        return results_file.recipe(self.results, name)

    def accuracy(self, recipe: str, key: str) -> float | None:
        r = self.recipe(recipe)
        return None if r is None else r.metric(key)

    def latency_ratio(self, recipe: str) -> tuple[float | None, int | None]:
        """INT8/FP32 p50 on the CPU provider at the largest batch where both were measured."""
        return results_file.p50_ratio(self.results, recipe)

    def fp32_p50(self) -> tuple[float | None, int | None]:
        return results_file.fp32_p50(self.results)

    def residual(self) -> list[dict]:
        return results_file.residual(self.results)

    def max_ratio(self) -> float | None:
        ratios = finite(r.get("ratio") for r in self.residual())
        return max(ratios) if ratios else None

    def max_kurtosis(self) -> float | None:
        k = finite(r.get("kurtosis") for r in self.residual())
        return max(k) if k else None

    def massive_count(self) -> int | None:
        return results_file.massive_count(self.results)

    def noise_levels(self) -> list[float]:
        return sorted({float(r["relative_noise"]) for r in self.perturbation or []
                       if finite([r.get("relative_noise")])})

    def logit_change(self, noise: float) -> float | None:
        """Relative logit change at relative weight noise ``noise`` (perturbation probe)."""
        for r in self.perturbation or []:
            if finite([r.get("relative_noise")]) and float(r["relative_noise"]) == noise:
                v = finite([r.get("relative_logit_change")])
                return v[0] if v else None
        return None

    def log_logit_change(self, noise: float) -> float | None:
        v = self.logit_change(noise)
        return math.log(v) if v is not None and v > 0 else None

    def late_cosine(self) -> float | None:
        """Mean cosine(block output, block input) over the last half of the blocks (the middle one
        included when the depth is odd; the only block at depth 1)."""
        cos = self.block_cosine or []
        values = finite(cos[len(cos) // 2:])
        return sum(values) / len(values) if values and len(values) == len(cos[len(cos) // 2:]) else None

    def cosine_slope(self) -> float | None:
        """Least-squares slope of cosine(block output, block input) over the block index (>= 2 blocks)."""
        cos = self.block_cosine or []
        values = finite(cos)
        if len(values) < 2 or len(values) != len(cos):
            return None
        return line_fit(range(len(values)), values)[0]


@dataclass
class Sweep:
    path: Path
    cells: list[CellResult]
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)   # cells left out, and why
    collapse_margin: float = DEFAULT_COLLAPSE_MARGIN

    @property
    def depths(self) -> list[int]:
        return sorted({c.depth for c in self.cells})

    @property
    def warmups(self) -> list[int]:
        return sorted({c.warmup for c in self.cells})

    @property
    def lrs(self) -> list[float]:
        return sorted({c.lr for c in self.cells if c.lr is not None})

    @property
    def seeds(self) -> list[int]:
        return sorted({c.seed for c in self.cells})

    @property
    def not_trained(self) -> list[CellResult]:
        return sorted((c for c in self.cells if not c.trained), key=lambda c: (order_key(c.group), c.seed))

    def trained_view(self) -> Sweep:
        """The same sweep with only its trained cells: every effect is computed on this view."""
        return Sweep(self.path, [c for c in self.cells if c.trained], self.manifest, self.problems,
                     self.collapse_margin)

    def groups(self) -> dict[tuple, list[CellResult]]:
        out: dict[tuple, list[CellResult]] = {}
        for c in sorted(self.cells, key=lambda c: (order_key(c.group), c.seed)):
            out.setdefault(c.group, []).append(c)
        return out

    def label(self, group: tuple) -> str:
        placement, norm, depth, warmup, lr = (tuple(group) + (None,))[:5]
        return f"{placement}/{norm}" + self.axes_label(depth=depth, warmup=warmup, lr=lr)

    def axes_label(self, *, norm: str | None = None, depth: int | None = None, warmup: int | None = None,
                   lr: float | None = None, placement: str | None = None) -> str:
        """The axes that vary in this sweep, as ' L8 w30 lr0.003' (norm and placement when given)."""
        parts = [x for x in (placement, norm) if x is not None]
        if depth is not None and len(self.depths) > 1:
            parts.append(f"L{depth}")
        if warmup is not None and len(self.warmups) > 1:
            parts.append(f"w{warmup}")
        if lr is not None and len(self.lrs) > 1:
            parts.append(f"lr{lr:g}")
        return (" " + " ".join(parts)) if parts else ""

    def recipes(self) -> list[str]:
        """Recipe names in the order the cells list them (the first is the primary recipe)."""
        names: dict[str, None] = {}
        for c in self.cells:
            for n in c.recipe_names():
                names.setdefault(n, None)
        return list(names)

    def select(self, **where) -> list[CellResult]:
        return [c for c in self.cells if all(getattr(c, k) == v for k, v in where.items())]


def order_key(group: tuple) -> tuple:
    placement, norm, depth, warmup, lr = (tuple(group) + (None,))[:5]
    p = PLACEMENT_ORDER.index(placement) if placement in PLACEMENT_ORDER else len(PLACEMENT_ORDER)
    n = NORM_ORDER.index(norm) if norm in NORM_ORDER else len(NORM_ORDER)
    return (p, placement, n, norm, depth, warmup, lr if lr is not None else 0.0)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _step0(cell_dir: Path) -> dict:
    try:
        with open(cell_dir / TRAIN_LOG_FILE, encoding="utf-8") as log:
            first = json.loads(log.readline())
        return first if isinstance(first, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _status(train: dict, data: dict | None, margin: float | None) -> dict:
    try:
        st = status_from_results(train, data, margin)
    except DataError as exc:
        raise RunDirError(f"training status unknown ({exc})") from None
    return {"status": st.status, "unigram": st.unigram_bits_per_byte, "status_derived": st.derived}


def load_cell(cell_dir: Path, margin: float | None = None) -> CellResult | None:
    """A finished cell, or None when the directory holds no finished cell. Raises RunDirError for
    a results.json that cannot be used (corrupt, other schema, no way to tell its training status)."""
    cell_dir = Path(cell_dir)
    step0 = _step0(cell_dir)
    if (cell_dir / RESULTS_FILE).is_file():
        results = results_file.load(cell_dir / RESULTS_FILE)
        try:
            m, t = results["model"], results["train"]
            tc = t["config"]
            perturbation, block_cosine = results_file.diagnostics(results)
            status = _status(t, results.get("data"), margin)
            return CellResult(cell_dir.name, cell_dir, m["placement"], m["norm"], int(m["n_layers"]),
                              int(tc["warmup"]), int(tc["seed"]), bool(t.get("diverged")), t, results,
                              step0.get("grad_norm_per_layer"), perturbation=perturbation,
                              block_cosine=block_cosine, **status,
                              grad_ffn0=step0.get("grad_norm_ffn_per_layer"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RunDirError(f"{cell_dir / RESULTS_FILE} lacks {exc} (model / train.config)") from None
    summary, config = cell_dir / TRAIN_SUMMARY_FILE, cell_dir / CONFIG_FILE
    if summary.is_file() and config.is_file():
        try:
            train, cfg = _read_json(summary), _read_json(config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunDirError(f"{cell_dir}: unreadable train.json/config.json ({exc})") from None
        if train.get("diverged") is True:
            try:
                m, tc = cfg["model"], cfg["train"]
                return CellResult(cell_dir.name, cell_dir, m["placement"], m["norm"], int(m["n_layers"]),
                                  int(tc["warmup"]), int(tc["seed"]), True, {**train, "config": tc}, None,
                                  step0.get("grad_norm_per_layer"), status=DIVERGED,
                                  grad_ffn0=step0.get("grad_norm_ffn_per_layer"))
            except (KeyError, TypeError, ValueError) as exc:
                raise RunDirError(f"{cell_dir / CONFIG_FILE} lacks {exc}") from None
    return None


CELLS_DIR = "cells"   # a published sweep (tools/publish_sweep.py) keeps its cells under cells/


def cell_dirs(sweep_dir: Path) -> list[Path]:
    """The cell directories of a sweep: ``DIR/<cell>/`` as `quantnorm sweep` writes them, or
    ``DIR/cells/<cell>/`` in a published copy."""
    root = sweep_dir / CELLS_DIR if (sweep_dir / CELLS_DIR).is_dir() else sweep_dir
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name not in (PLOTS_DIR, CELLS_DIR))


def load_sweep(sweep_dir: str | Path, margin: float | None = None) -> Sweep:
    """Every finished cell under ``sweep_dir``; unusable and unfinished cells are listed as problems.
    ``margin``: the collapse margin in bits/byte (None: each run's recorded one, else the default)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise RunDirError(f"{sweep_dir} is not a directory: pass the --out directory of `quantnorm sweep`")
    if margin is not None:
        try:
            margin = check_margin(margin, "--collapse-margin")
        except DataError as exc:
            raise RunDirError(str(exc)) from None
    manifest = read_manifest(sweep_dir) if (sweep_dir / MANIFEST_FILE).is_file() else None
    cells, problems = [], []
    for cell_dir in cell_dirs(sweep_dir):
        try:
            cell = load_cell(cell_dir, margin)
        except RunDirError as exc:
            problems.append(f"`{cell_dir.name}` left out: {exc}")
            continue
        if cell is None:
            entry = ((manifest or {}).get("cells") or {}).get(cell_dir.name, {})
            if entry.get("status") == "failed":
                tail = entry.get("log_tail") or []
                problems.append(f"`{cell_dir.name}` failed (exit code {entry.get('rc')}): "
                                f"{tail[-1] if tail else 'no output'} (see {cell_dir.name}/evaluate.log)")
            else:
                problems.append(f"`{cell_dir.name}` not finished (no results.json)")
            continue
        cells.append(cell)
    if not cells:
        raise RunDirError(f"{sweep_dir} holds no finished cell (no <cell>/results.json or cells/<cell>/results.json):"
                          f" run `quantnorm sweep` first")
    return Sweep(sweep_dir, cells, manifest, problems,
                 margin if margin is not None else DEFAULT_COLLAPSE_MARGIN)


def group_estimate(cells: list[CellResult], metric: Callable[[CellResult], float | None]) -> Estimate:
    return estimate(metric(c) for c in cells)


def best_recipe(sweep: Sweep, cells: list[CellResult]) -> tuple[str | None, Estimate]:
    """The recipe with the lowest mean PPL ratio in a group, and its estimate."""
    best: tuple[str | None, Estimate] = (None, Estimate(None, None, None, 0))
    for name in sweep.recipes():
        est = group_estimate(cells, lambda c, n=name: c.accuracy(n, "ppl_ratio"))
        if est.mean is not None and (best[1].mean is None or est.mean < best[1].mean):
            best = (name, est)
    return best


@dataclass(frozen=True)
class RankRow:
    rank: int
    group: tuple
    label: str
    what: str
    est: Estimate
    not_significant: bool   # its interval overlaps the row above's


def rank(items: list[tuple[tuple, str, str, Estimate]]) -> list[RankRow]:
    """Ascending by mean; rows without a value go last. Each row is marked not significant when
    its interval overlaps the previous row's."""
    valued = sorted([i for i in items if i[3].mean is not None], key=lambda i: i[3].mean)
    rows: list[RankRow] = []
    for k, (group, label, what, est) in enumerate(valued):
        ns = k > 0 and est.overlaps(valued[k - 1][3])
        rows.append(RankRow(k + 1, group, label, what, est, ns))
    for group, label, what, est in items:
        if est.mean is None:
            rows.append(RankRow(len(rows) + 1, group, label, what, est, False))
    return rows


def residual_series(cell: CellResult, key: str) -> tuple[list[str], list[float | None]]:
    rows = cell.residual()
    return [str(r.get("layer")) for r in rows], [r.get(key) for r in rows]


def placements_in(sweep: Sweep, cells: Iterable[CellResult] | None = None) -> list[str]:
    """The placements of ``cells`` (default: the sweep's), in report order."""
    present = {c.placement for c in (sweep.cells if cells is None else cells)}
    return [p for p in PLACEMENT_ORDER if p in present] + sorted(present - set(PLACEMENT_ORDER))
