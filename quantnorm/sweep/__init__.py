"""Sweeps: every placement x norm (x warm-up x depth) x seed, each cell trained and evaluated in its
own process, resumable, with a comparison report at the end.

Layout of a sweep directory::

    sweep.json                 the manifest: settings (the axes, the training flags and the one
                               EvaluateConfig every cell gets), and each cell's configuration and last status
    <cell>/                    one run directory per cell
    <cell>/cell.json           the cell's RunConfig and EvaluateConfig, serialized; the cell's process is
                               ``quantnorm evaluate --config <cell>/cell.json --out <cell>``
    <cell>/evaluate.log        the cell's stdout and stderr
    report.md, plots/          the comparison report (``quantnorm.compare``)

A cell is *finished* when its ``results.json`` parses, has the supported schema and describes
that cell, or when its ``train.json`` (written last by training) says training diverged: a
diverged model is a measurement, not a failure. Anything else in a cell directory is redone:
``evaluate`` reuses a complete checkpoint of the same config and retrains otherwise. Every file
is written atomically (temporary file + rename), so a SIGKILL loses at most the cells in flight;
the temporaries a kill leaves behind are removed before a cell is redone.

The package: ``grid`` (the sweep's settings and its cells' configurations), ``cells`` (a cell's
directory state, lock and process), ``state`` (sweep.json and resuming a directory),
``executors`` (local processes or Ray tasks); here, ``run_sweep``, which runs them in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..errors import ConfigError
from ..manifest import MANIFEST_FILE
from ..report import write_comparison
from .cells import (
    CELL_LOG_FILE,
    CELL_PID_FILE,
    LOCK_FILE,
    LOG_TAIL_LINES,
    cell_lock,
    cell_status,
    clean_stale_temporaries,
    log_tail,
    run_cell_process,
)
from .executors import EXECUTORS, RAY_HINT, available_cores, default_jobs, ray_module, run_local, run_ray, thread_env
from .grid import AXES, CELL_CONFIG_FILE, Cell, SweepConfig, cell_args, cell_config, read_cell_config, validate
from .state import Manifest, check_compatible, now, plan, previous_settings

__all__ = [
    "AXES", "CELL_CONFIG_FILE", "CELL_LOG_FILE", "CELL_PID_FILE", "EXECUTORS", "LOCK_FILE", "LOG_TAIL_LINES",
    "MANIFEST_FILE", "RAY_HINT", "Cell", "CellOutcome", "SweepConfig", "SweepOutcome", "available_cores", "cell_args",
    "cell_config", "cell_lock", "cell_status", "check_compatible", "clean_stale_temporaries", "default_jobs",
    "log_tail", "plan", "previous_settings", "read_cell_config", "run_cell_process", "run_sweep", "validate",
]


@dataclass
class CellOutcome:
    cell: Cell
    status: str              # done | diverged | failed | skipped
    rc: int | None = None
    seconds: float | None = None
    log_tail: list[str] = field(default_factory=list)


@dataclass
class SweepOutcome:
    out_dir: Path
    cells: list[CellOutcome]
    report: Path | None

    @property
    def failed(self) -> list[CellOutcome]:
        return [c for c in self.cells if c.status == "failed"]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.cells:
            out[c.status] = out.get(c.status, 0) + 1
        return out


def run_sweep(cfg: SweepConfig, out_dir: str | Path, *, jobs: int | None = None, executor: str = "local",
              ray_address: str | None = None, progress: bool = True, command: str = "",
              report: bool = True, echo: Callable[[str], None] = print) -> SweepOutcome:
    """Run every unfinished cell (train + evaluate, each in its own process) and write the report.

    Bad input raises ConfigError/RunDirError/DataError before anything is written. A failing cell
    is recorded (exit code and the end of its log) and the other cells go on.
    """
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}: choose from {', '.join(EXECUTORS)}")
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    ray = ray_module() if executor == "ray" else None
    out_dir = Path(out_dir).expanduser().resolve()
    cells, previous = plan(cfg, out_dir)

    if executor == "local":
        jobs = jobs or default_jobs()
        threads = cfg.evaluate.threads or max(1, available_cores() // jobs)
    else:
        threads = cfg.evaluate.threads or 2

    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries_top(out_dir)
    manifest = Manifest(out_dir / MANIFEST_FILE, cfg, command, jobs, executor, previous)
    outcomes, todo = _skip_finished(cells, out_dir, manifest)
    if outcomes:
        echo(f"{out_dir}: {len(outcomes)} of {len(cells)} cells already finished, skipped")

    env = thread_env(threads)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="sweep", unit="cell", disable=not progress,
               dynamic_ncols=True)
    book = _CellBook(cfg, out_dir, threads, manifest, bar, outcomes)
    try:
        # run_cell_process as this module has it (a test replaces it here)
        if todo and executor == "local":
            run_local(todo, jobs, book.start, book.finish, env, run_cell_process)
        elif todo:
            run_ray(ray, todo, jobs, ray_address, threads, book.start, book.finish, env, manifest, run_cell_process)
    finally:
        bar.close()
        manifest.write()

    report_path = None
    finished = [o for o in outcomes.values() if o.status in ("done", "diverged", "skipped")]
    if report and finished:
        report_path = write_comparison(out_dir)
    ordered = [outcomes[c.name] for c in cells]
    return SweepOutcome(out_dir, ordered, report_path)


def _skip_finished(cells: list[Cell], out_dir: Path, manifest: Manifest) -> tuple[dict[str, CellOutcome], list[Cell]]:
    """(the finished cells' outcomes, "skipped"; the cells to run); records the finished ones."""
    outcomes: dict[str, CellOutcome] = {}
    todo: list[Cell] = []
    for cell in cells:
        status = cell_status(out_dir / cell.name, cell)
        if status is not None:
            outcomes[cell.name] = CellOutcome(cell, "skipped")
            entry = manifest.data["cells"].get(cell.name, {})
            if entry.get("status") not in ("done", "diverged"):
                manifest.set(cell, status=status)
        else:
            todo.append(cell)
    manifest.write()
    return outcomes, todo


class _CellBook:
    """What the sweep's main thread records as an executor starts and finishes each cell: its
    cell.json and manifest entry, its outcome, the progress bar."""

    def __init__(self, cfg: SweepConfig, out_dir: Path, threads: int, manifest: Manifest, bar,
                 outcomes: dict[str, CellOutcome]):
        self.cfg, self.out_dir, self.threads = cfg, out_dir, threads
        self.manifest, self.bar, self.outcomes = manifest, bar, outcomes

    def start(self, cell: Cell) -> tuple[list[str], Path, dict]:
        cell_dir = self.out_dir / cell.name
        cell_dir.mkdir(parents=True, exist_ok=True)
        # ONNX Runtime sizes its pool to the machine unless told: give each cell its share of the cores
        config = cell.config(self.cfg, self.threads)
        self.manifest.set(cell, status="running", started=now(), config=config)
        self.manifest.write()
        return cell_args(cell_dir), cell_dir / CELL_LOG_FILE, config

    def finish(self, cell: Cell, rc: int, seconds: float) -> None:
        cell_dir = self.out_dir / cell.name
        status = cell_status(cell_dir, cell)
        log = cell_dir / CELL_LOG_FILE
        if rc == 0 and status == "done":
            outcome = CellOutcome(cell, "done", rc, seconds)
        elif status == "diverged":
            outcome = CellOutcome(cell, "diverged", rc, seconds, log_tail(log, 3))
        else:
            tail = log_tail(log)
            if rc == 0:
                tail.append("(exit code 0 but no valid results.json)")
            outcome = CellOutcome(cell, "failed", rc, seconds, tail)
        self.outcomes[cell.name] = outcome
        entry = {"status": outcome.status, "rc": rc, "seconds": round(seconds, 1), "finished": now(),
                 "log": f"{cell.name}/{CELL_LOG_FILE}"}
        if outcome.status == "failed":
            entry["log_tail"] = outcome.log_tail
            self.bar.write(f"cell {cell.name} failed (exit code {rc}): "
                           f"{outcome.log_tail[-1] if outcome.log_tail else 'no output'} [{log}]")
        self.manifest.set(cell, **entry)
        self.manifest.write()
        self.bar.set_postfix_str(f"{cell.name}: {outcome.status}")
        self.bar.update(1)


def clean_stale_temporaries_top(out_dir: Path) -> None:
    """Temporaries of sweep.json / report.md (not the cells': each is cleaned when redone)."""
    for path in list(out_dir.glob(".*.tmp")) + list((out_dir / "plots").glob(".*.tmp")):
        path.unlink(missing_ok=True)
