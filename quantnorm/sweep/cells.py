"""One cell of a sweep: its directory's state (finished, diverged or to do), the temporaries a
killed attempt leaves, its lock, and its process (``quantnorm evaluate --config cell.json``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ..errors import RunDirError
from ..fileio import write_json_atomic, write_text_atomic
from ..results import load as load_results
from ..runs import CONFIG_FILE, RESULTS_FILE, TRAIN_SUMMARY_FILE
from .grid import CELL_CONFIG_FILE, Cell

CELL_LOG_FILE = "evaluate.log"
LOG_TAIL_LINES = 15


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
