"""Where a sweep's cells run: local subprocesses a few at a time, or Ray tasks (each a process on
a Ray worker); the threads each cell gets."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from ..errors import ConfigError
from .grid import Cell
from .state import Manifest

EXECUTORS = ("local", "ray")
RAY_HINT = "pip install 'quantnorm[ray]'"


def thread_env(threads: int) -> dict[str, str]:
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"}


def append_log(path: Path, line: str) -> None:
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
    except OSError:
        pass


def ray_module():
    try:
        import ray  # the optional quantnorm[ray] extra, only for --executor ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))   # honours taskset / container CPU sets
    except AttributeError:
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Training uses about 2 threads; one cell per 2 cores."""
    return max(1, available_cores() // 2)


def run_local(todo: list[Cell], jobs: int, start, finish, env: dict[str, str], run: Callable[..., int]) -> None:
    """Cells as subprocesses (``run``: ``run_cell_process``), ``jobs`` at a time (threads only wait on them)."""
    pending = list(todo)
    running: dict[Future, tuple[Cell, float, Path]] = {}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="quantnorm-cell") as pool:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    cell = pending.pop(0)
                    args, log, config = start(cell)
                    running[pool.submit(run, args, str(log), env, cell, config)] = (
                        cell, time.perf_counter(), log)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    cell, t0, log = running.pop(fut)
                    try:
                        rc = fut.result()
                    except Exception as exc:  # the process could not be started
                        rc = -1
                        append_log(log, f"could not start the cell: {exc}")
                    finish(cell, rc, time.perf_counter() - t0)
        except BaseException:
            for fut in running:
                fut.cancel()
            raise


def run_ray(ray, todo: list[Cell], jobs: int | None, address: str | None, threads: int, start, finish,
            env: dict[str, str], manifest: Manifest, run: Callable[..., int]) -> None:
    """Cells as Ray tasks of ``run`` (``run_cell_process``), at most ``jobs`` at a time."""
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
        except Exception as exc:  # ConnectionError, RuntimeError, ValueError ... depending on the Ray version
            raise ConfigError(f"cannot start or reach Ray{f' at {address}' if address else ''}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    manifest.data["ray"] = {"address": address or "local", "version": getattr(ray, "__version__", None)}
    remote = ray.remote(num_cpus=threads, max_retries=0)(run)
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
                    append_log(log, f"Ray task failed: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                finish(cell, rc, time.perf_counter() - t0)
    except BaseException:
        for ref in running:
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass
        raise
