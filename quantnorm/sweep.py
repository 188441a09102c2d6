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
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from tqdm import tqdm

from . import serial
from .config import AUTO, SEARCH_ONLY_FIELDS, EvaluateConfig
from .data import BUILTIN_PYDOC, DataConfig, prepare_data
from .errors import ConfigError, RunDirError
from .fileio import write_json_atomic, write_text_atomic
from .manifest import MANIFEST_FILE, MANIFEST_VERSION, read_manifest
from .models import NORMS, PLACEMENTS, ModelConfig
from .quantize import DEFAULT_RECIPES
from .report import write_comparison
from .results import load as load_results
from .runs import CONFIG_FILE, RESULTS_FILE, TRAIN_SUMMARY_FILE
from .train import RunConfig, TrainConfig, default_warmup

CELL_LOG_FILE = "evaluate.log"
LOG_TAIL_LINES = 15
EXECUTORS = ("local", "ray")
RAY_HINT = "pip install 'quantnorm[ray]'"

CELL_CONFIG_FILE = "cell.json"
# The settings a sweep directory's cells may differ in: its axes, which may grow. Every other
# setting (the training flags, each field of the EvaluateConfig) must stay equal.
AXES = ("placements", "norms", "seeds", "warmups", "depths", "lrs")


def _unique(values, what: str) -> tuple:
    out = tuple(dict.fromkeys(values))
    if not out:
        raise ConfigError(f"no {what} given: pass at least one value")
    return out


@dataclass(frozen=True)
class SweepConfig:
    """The grid, the training flags every cell shares and the one EvaluateConfig every cell gets.
    Validated at construction; nothing is written."""

    placements: tuple[str, ...] = tuple(PLACEMENTS)
    norms: tuple[str, ...] = tuple(NORMS)
    seeds: int = 3
    warmups: tuple[int, ...] | None = None   # None: train.default_warmup(steps), as `quantnorm train`
    depths: tuple[int, ...] = (ModelConfig.n_layers,)
    # None: every cell trains at ``lr``. A tuple is a learning-rate axis: the report compares each
    # placement at its own best rate, chosen on held-out seeds (compare.tuned_comparison)
    lrs: tuple[float, ...] | None = None
    d_model: int = ModelConfig.d_model
    heads: int = ModelConfig.n_heads
    context: int = ModelConfig.context
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    corpus: str = BUILTIN_PYDOC
    # Every cell gets this, as it stands, but for ``threads`` when it is None (the executor gives
    # each cell its share of the cores) and ``progress`` (off: a cell writes to its log file).
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(progress=False))

    def __post_init__(self) -> None:
        placements = _unique(self.placements, "placements")
        norms = _unique(self.norms, "norms")
        for p in placements:
            if p not in PLACEMENTS:
                raise ConfigError(f"unknown placement {p!r} in --placements: choose from {', '.join(PLACEMENTS)}")
        for n in norms:
            if n not in NORMS:
                raise ConfigError(f"unknown norm {n!r} in --norms: choose from {', '.join(NORMS)}")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"--seeds is the number of seeds and must be >= 1, got {self.seeds}")
        depths = _unique(self.depths, "depths")
        if min(depths) < 1:
            raise ConfigError(f"--depths must be >= 1 layers, got {min(depths)}")
        warmups = None if self.warmups is None else _unique(self.warmups, "warm-ups")
        if warmups is not None and min(warmups) < 0:
            raise ConfigError(f"--warmups must be >= 0 steps, got {min(warmups)}")
        lrs = None if self.lrs is None else _unique((float(x) for x in self.lrs), "learning rates")
        if lrs is not None and not all(x > 0 and x == x and x != float("inf") for x in lrs):
            raise ConfigError(f"--lrs must be positive learning rates, got {', '.join(map(repr, lrs))}")
        object.__setattr__(self, "lrs", lrs)
        if self.corpus != BUILTIN_PYDOC:
            object.__setattr__(self, "corpus", str(Path(self.corpus).expanduser().resolve()))
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "norms", norms)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "warmups", warmups)
        if self.evaluate.progress:
            object.__setattr__(self, "evaluate", replace(self.evaluate, progress=False))

    def cells(self) -> list[Cell]:
        warmups = self.warmups if self.warmups is not None else (default_warmup(self.steps),)
        lrs = self.lrs if self.lrs is not None else (None,)
        return [Cell(p, n, d, w, s, lr) for d in self.depths for w in warmups for lr in lrs for p in self.placements
                for n in self.norms for s in range(self.seeds)]

    def to_dict(self) -> dict:
        """sweep.json's ``settings``: the axes and training flags under their flag names (what the
        comparison report prints), and ``evaluate``, the serialized EvaluateConfig."""
        return serial.to_dict(self)


@dataclass(frozen=True)
class Cell:
    placement: str
    norm: str
    depth: int
    warmup: int
    seed: int
    lr: float | None = None   # None: the sweep's --lr (and no lr in the name, as before the axis existed)

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        return f"{self.placement}-{self.norm}-L{self.depth}-w{self.warmup}{lr}-seed{self.seed}"

    def lr_of(self, cfg: SweepConfig) -> float:
        return cfg.lr if self.lr is None else self.lr

    def run_config(self, cfg: SweepConfig) -> RunConfig:
        return RunConfig(
            model=ModelConfig(placement=self.placement, norm=self.norm, n_layers=self.depth, d_model=cfg.d_model,
                              n_heads=cfg.heads, context=cfg.context),
            train=TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=self.lr_of(cfg), warmup=self.warmup,
                              seed=self.seed),
            data=DataConfig(corpus=cfg.corpus),
        )

    def config(self, cfg: SweepConfig, threads: int | None) -> dict:
        """What the cell's process is given (its cell.json): the RunConfig to train and the
        sweep's EvaluateConfig, with ``threads`` when the sweep left them to the executor."""
        evaluate = cfg.evaluate if cfg.evaluate.threads is not None else replace(cfg.evaluate, threads=threads)
        return cell_config(self.run_config(cfg), evaluate)


def cell_config(run: RunConfig, evaluate: EvaluateConfig) -> dict:
    return {"run": run.to_dict(), "evaluate": evaluate.to_dict()}


def read_cell_config(path: str | Path) -> tuple[RunConfig, EvaluateConfig]:
    """The RunConfig and EvaluateConfig of a cell.json (``quantnorm evaluate --config FILE``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--config {path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict) or set(data) != {"run", "evaluate"}:
        keys = ", ".join(map(repr, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--config {path} must be a JSON object with the keys 'run' and 'evaluate', got {keys}")
    return (RunConfig.from_dict(data["run"], f"--config {path}: run"),
            EvaluateConfig.from_dict(data["evaluate"], f"--config {path}: evaluate"))


def cell_args(cell_dir: Path) -> list[str]:
    """The `quantnorm` arguments of a cell's process: everything else is in its cell.json."""
    return ["evaluate", "--config", str(cell_dir / CELL_CONFIG_FILE), "--out", str(cell_dir), "--quiet"]


def validate(cfg: SweepConfig) -> list[Cell]:
    """Check everything a cell would check (model and training configs, the corpus; the
    EvaluateConfig validated itself) before anything is written; returns the cells."""
    cells = cfg.cells()
    for cell in cells:
        cell.run_config(cfg)  # ConfigError on e.g. heads not dividing d_model, warm-up longer than training
    prepare_data(DataConfig(corpus=cfg.corpus), cfg.context)  # DataError on a missing/empty/small corpus
    return cells


# ---------------------------------------------------------------------------------------- state


def cell_status(cell_dir: Path, cell: Cell | None = None) -> str | None:
    """"done" (valid results.json of this cell), "diverged" (training diverged) or None (to do)."""
    results_path = cell_dir / RESULTS_FILE
    if results_path.is_file():
        try:
            results = load_results(results_path)
            model, train_cfg = results["model"], results["train"]["config"]
            if not isinstance(results["recipes"], list):
                return None
            if cell is not None and (model["placement"], model["norm"], model["n_layers"], train_cfg["warmup"],
                                     train_cfg["seed"]) != (cell.placement, cell.norm, cell.depth, cell.warmup,
                                                            cell.seed):
                return None
            if cell is not None and cell.lr is not None and train_cfg.get("lr") != cell.lr:
                return None
            return "done"
        except (RunDirError, KeyError, TypeError):
            return None
    summary, config = cell_dir / TRAIN_SUMMARY_FILE, cell_dir / CONFIG_FILE
    if summary.is_file() and config.is_file():
        try:
            if json.loads(summary.read_text(encoding="utf-8")).get("diverged") is True:
                return "diverged"
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
    return None


def clean_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files (``.<name>.*.tmp``) an atomic write leaves when it is killed."""
    removed = []
    if directory.is_dir():
        for path in directory.rglob(".*.tmp"):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    # progress bars rewrite their line with \r: keep each line's last state
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines() if line.strip()][-lines:]


LOCK_FILE = ".cell.lock"
CELL_PID_FILE = ".cell.pid"  # the PID of the cell's `quantnorm evaluate` process while it runs


@contextmanager
def cell_lock(cell_dir: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[IO | None]:
    """Hold ``cell_dir/.cell.lock`` (an exclusive flock) while the cell runs.

    The cell's process inherits the locked descriptor, so the lock lasts as long as that process:
    a sweep killed alone (not its process group) leaves its cells running, and a sweep started
    again on the same directory waits for them instead of running the cell twice into one
    directory. None on systems without ``fcntl``.
    """
    try:
        import fcntl  # POSIX only
    except ImportError:  # not POSIX: no locking
        yield None
        return
    cell_dir.mkdir(parents=True, exist_ok=True)
    with open(cell_dir / LOCK_FILE, "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(f"{cell_dir.name}: another process is running this cell; waiting for it to end")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield lock
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_cell_process(args: list[str], log_path: str, env_overrides: dict[str, str], cell: Cell | None = None,
                     config: dict | None = None) -> int:
    """Run ``python -m quantnorm.cli ARGS`` with output to ``log_path`` (in the cell's directory);
    returns its exit code.

    Under the cell's lock: a cell that another process finished meanwhile is not run again (0);
    otherwise the temporaries of a killed earlier attempt and a results.json that is not this
    cell's are removed first, so a half-done directory is simply redone, and ``config`` (the
    cell's, see Cell.config) is written to its cell.json, which ARGS name. Module-level so that Ray
    can ship it to a worker (which needs quantnorm installed and the sweep directory on a file
    system it shares with the driver).
    """
    log_path = Path(log_path)
    cell_dir = log_path.parent
    with cell_lock(cell_dir, on_wait=_warn) as lock:
        if cell is not None and cell_status(cell_dir, cell) is not None:
            return 0
        clean_stale_temporaries(cell_dir)
        if cell is not None and (cell_dir / RESULTS_FILE).exists():  # not valid for this cell (checked above)
            (cell_dir / RESULTS_FILE).unlink()
        if config is not None:
            write_json_atomic(cell_dir / CELL_CONFIG_FILE, config)
        env = {**os.environ, **env_overrides}
        cmd = [sys.executable, "-m", "quantnorm.cli", *args]
        with open(log_path, "w", encoding="utf-8") as log:
            log.write(f"$ {' '.join(shlex.quote(c) for c in cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    pass_fds=(lock.fileno(),) if lock is not None else ())
            # Which process is this cell's, wherever it runs (a Ray worker's child on another node):
            # an operator, or a test, can stop one cell without touching the others.
            pid_file = cell_dir / CELL_PID_FILE
            write_text_atomic(pid_file, f"{proc.pid}\n")
            try:
                return proc.wait()
            except BaseException:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise
            finally:
                pid_file.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ executors


@dataclass
class CellOutcome:
    cell: Cell
    status: str              # done | diverged | failed | skipped
    rc: int | None = None
    seconds: float | None = None
    log_tail: list[str] = field(default_factory=list)


def _thread_env(threads: int) -> dict[str, str]:
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"}


def _append_log(path: Path, line: str) -> None:
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
    except OSError:
        pass


def _ray_module():
    try:
        import ray  # the optional quantnorm[ray] extra, only for --executor ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


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


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))   # honours taskset / container CPU sets
    except AttributeError:
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Training uses about 2 threads; one cell per 2 cores."""
    return max(1, available_cores() // 2)


class _Manifest:
    """sweep.json, rewritten atomically after every change (only by the sweep's main thread)."""

    def __init__(self, path: Path, cfg: SweepConfig, command: str, jobs: int | None, executor: str,
                 previous: dict | None):
        self.path = path
        # Every invocation that grew or resumed this directory, oldest first (a directory whose axes
        # grew needs all of them to be reproduced); "command" stays the latest one.
        commands = list((previous or {}).get("commands") or
                        ([previous["command"]] if (previous or {}).get("command") else []))
        if command:
            commands = [c for c in commands if c != command] + [command]
        self.data = {
            "sweep_version": MANIFEST_VERSION,
            "command": command,
            "commands": commands,
            "created": (previous or {}).get("created") or _now(),
            "updated": _now(),
            "settings": cfg.to_dict(),
            "executor": executor,
            "jobs": jobs,
            "cells": dict((previous or {}).get("cells", {})),
        }

    def set(self, cell: Cell, **entry) -> None:
        """Replace the cell's entry; its ``config`` (the cell.json it last ran with) stays until a new one is given."""
        config = entry.pop("config", None) or self.data["cells"].get(cell.name, {}).get("config")
        self.data["cells"][cell.name] = {"placement": cell.placement, "norm": cell.norm, "depth": cell.depth,
                                         "warmup": cell.warmup, "seed": cell.seed,
                                         **({} if cell.lr is None else {"lr": cell.lr}), **entry,
                                         **({} if config is None else {"config": config})}

    def write(self) -> None:
        self.data["updated"] = _now()
        write_json_atomic(self.path, self.data)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_compatible(previous: dict | None, cfg: SweepConfig, out_dir: Path) -> None:
    """A sweep directory holds one configuration: the axes may grow, every other setting (the
    training flags and each field of the serialized EvaluateConfig) may not change."""
    if previous is None:
        return
    old, new = previous_settings(previous, out_dir), cfg.to_dict()
    old_evaluate = old.get("evaluate") or {}
    diffs = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in new.items() if k not in AXES and k != "evaluate"
             and old.get(k) != v]
    # a sweep that never searches ran no differently under other search targets (a manifest written
    # before the search took the policy's defaults records None for them)
    searches = AUTO in (old_evaluate.get("recipes") or ()) or AUTO in new["evaluate"]["recipes"]
    diffs += [f"evaluate.{k} {old_evaluate.get(k)!r} -> {v!r}" for k, v in new["evaluate"].items()
              if old_evaluate.get(k) != v and (searches or k not in SEARCH_ONLY_FIELDS)]
    if diffs:
        raise ConfigError(f"{out_dir} holds a sweep with other settings ({'; '.join(diffs)}): "
                          f"use the same flags to resume it, or another --out")


# Version 1 of sweep.json spelled, beside the axes, the evaluate flags the sweep passed to each
# cell (the others were at evaluate's defaults): these keys, with their defaults of then.
_V1_EVALUATE_FLAGS = {"recipes": None, "providers": None, "calib_samples": 64, "opset": 18, "opt_level": "all",
                      "threads": None, "batches": [1, 8], "iters": 30, "outliers": True, "sq_alpha": None}


def previous_settings(previous: dict, out_dir: Path) -> dict:
    """A manifest's ``settings`` in this version's layout: a version-1 manifest's evaluate flags
    become the EvaluateConfig its cells ran with, so a version-1 sweep resumes with the same flags."""
    version = previous.get("sweep_version", 1)
    if not isinstance(version, int) or not 1 <= version <= MANIFEST_VERSION:
        raise RunDirError(f"{out_dir / MANIFEST_FILE} has sweep_version {version!r}; this quantnorm reads versions "
                          f"1 to {MANIFEST_VERSION}: resume it with the quantnorm that wrote it, or use another --out")
    settings = previous.get("settings") or {}
    if version >= 2:
        return settings
    flags = {k: settings.get(k, default) for k, default in _V1_EVALUATE_FLAGS.items()}
    try:
        evaluate = EvaluateConfig(
            recipes=tuple(flags["recipes"] or DEFAULT_RECIPES),
            providers=tuple(flags["providers"]) if flags["providers"] else None,
            calib_samples=flags["calib_samples"], opset=flags["opset"], graph_optimization_level=flags["opt_level"],
            threads=flags["threads"], latency_batches=tuple(flags["batches"]), latency_iters=flags["iters"],
            outliers=flags["outliers"], sq_alpha=flags["sq_alpha"], progress=False)
    except (ConfigError, TypeError) as exc:
        raise RunDirError(f"{out_dir / MANIFEST_FILE} (version 1) records evaluate settings this quantnorm cannot "
                          f"run ({exc}): use another --out") from None
    return {**{k: v for k, v in settings.items() if k not in _V1_EVALUATE_FLAGS}, "evaluate": evaluate.to_dict()}


def plan(cfg: SweepConfig, out_dir: Path) -> tuple[list[Cell], dict | None]:
    """Validate the sweep against its directory; nothing is written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out {out_dir} is an existing file: give a directory path")
    cells = validate(cfg)
    previous = read_manifest(out_dir)
    check_compatible(previous, cfg, out_dir)
    return cells, previous


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
    ray = _ray_module() if executor == "ray" else None
    out_dir = Path(out_dir).expanduser().resolve()
    cells, previous = plan(cfg, out_dir)

    if executor == "local":
        jobs = jobs or default_jobs()
        threads = cfg.evaluate.threads or max(1, available_cores() // jobs)
    else:
        threads = cfg.evaluate.threads or 2

    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries_top(out_dir)
    manifest = _Manifest(out_dir / MANIFEST_FILE, cfg, command, jobs, executor, previous)
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
    if outcomes:
        echo(f"{out_dir}: {len(outcomes)} of {len(cells)} cells already finished, skipped")

    env = _thread_env(threads)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="sweep", unit="cell", disable=not progress,
               dynamic_ncols=True)

    def start(cell: Cell) -> tuple[list[str], Path, dict]:
        cell_dir = out_dir / cell.name
        cell_dir.mkdir(parents=True, exist_ok=True)
        # ONNX Runtime sizes its pool to the machine unless told: give each cell its share of the cores
        config = cell.config(cfg, threads)
        manifest.set(cell, status="running", started=_now(), config=config)
        manifest.write()
        return cell_args(cell_dir), cell_dir / CELL_LOG_FILE, config

    def finish(cell: Cell, rc: int, seconds: float) -> None:
        cell_dir = out_dir / cell.name
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
        outcomes[cell.name] = outcome
        entry = {"status": outcome.status, "rc": rc, "seconds": round(seconds, 1), "finished": _now(),
                 "log": f"{cell.name}/{CELL_LOG_FILE}"}
        if outcome.status == "failed":
            entry["log_tail"] = outcome.log_tail
            bar.write(f"cell {cell.name} failed (exit code {rc}): "
                      f"{outcome.log_tail[-1] if outcome.log_tail else 'no output'} [{log}]")
        manifest.set(cell, **entry)
        manifest.write()
        bar.set_postfix_str(f"{cell.name}: {outcome.status}")
        bar.update(1)

    try:
        if todo and executor == "local":
            _run_local(todo, jobs, start, finish, env)
        elif todo:
            _run_ray(ray, todo, jobs, ray_address, threads, start, finish, env, manifest)
    finally:
        bar.close()
        manifest.write()

    report_path = None
    finished = [o for o in outcomes.values() if o.status in ("done", "diverged", "skipped")]
    if report and finished:
        report_path = write_comparison(out_dir)
    ordered = [outcomes[c.name] for c in cells]
    return SweepOutcome(out_dir, ordered, report_path)


def clean_stale_temporaries_top(out_dir: Path) -> None:
    """Temporaries of sweep.json / report.md (not the cells': each is cleaned when redone)."""
    for path in list(out_dir.glob(".*.tmp")) + list((out_dir / "plots").glob(".*.tmp")):
        path.unlink(missing_ok=True)


def _run_local(todo: list[Cell], jobs: int, start, finish, env: dict[str, str]) -> None:
    """Cells as subprocesses, ``jobs`` at a time (threads only wait on them)."""
    pending = list(todo)
    running: dict[Future, tuple[Cell, float, Path]] = {}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="quantnorm-cell") as pool:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    cell = pending.pop(0)
                    args, log, config = start(cell)
                    running[pool.submit(run_cell_process, args, str(log), env, cell, config)] = (
                        cell, time.perf_counter(), log)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    cell, t0, log = running.pop(fut)
                    try:
                        rc = fut.result()
                    except Exception as exc:  # the process could not be started
                        rc = -1
                        _append_log(log, f"could not start the cell: {exc}")
                    finish(cell, rc, time.perf_counter() - t0)
        except BaseException:
            for fut in running:
                fut.cancel()
            raise


def _run_ray(ray, todo: list[Cell], jobs: int | None, address: str | None, threads: int, start, finish,
             env: dict[str, str], manifest: _Manifest) -> None:
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
        except Exception as exc:  # ConnectionError, RuntimeError, ValueError ... depending on the Ray version
            raise ConfigError(f"cannot start or reach Ray{f' at {address}' if address else ''}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    manifest.data["ray"] = {"address": address or "local", "version": getattr(ray, "__version__", None)}
    remote = ray.remote(num_cpus=threads, max_retries=0)(run_cell_process)
    limit = jobs or len(todo)
    pending = list(todo)
    running: dict = {}
    try:
        while pending or running:
            while pending and len(running) < limit:
                cell = pending.pop(0)
                args, log, config = start(cell)
                running[remote.remote(args, str(log), env, cell, config)] = (cell, time.perf_counter(), log)
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                cell, t0, log = running.pop(ref)
                try:
                    rc = int(ray.get(ref))
                except Exception as exc:  # a task that died (worker lost, node gone)
                    rc = -1
                    _append_log(log, f"Ray task failed: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                finish(cell, rc, time.perf_counter() - t0)
    except BaseException:
        for ref in running:
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass
        raise
