"""A sweep directory's sweep.json as the sweep keeps it (rewritten after every change), and the
checks that a directory can be resumed with these settings (the axes may grow, nothing else may
change; a version-1 manifest is read into this version's layout)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from ..config import AUTO, SEARCH_ONLY_FIELDS, EvaluateConfig
from ..errors import ConfigError, RunDirError
from ..fileio import write_json_atomic
from ..manifest import MANIFEST_FILE, MANIFEST_VERSION, read_manifest
from ..quantize import DEFAULT_RECIPES
from .grid import AXES, Cell, SweepConfig, validate


class Manifest:
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
            "created": (previous or {}).get("created") or now(),
            "updated": now(),
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
        self.data["updated"] = now()
        write_json_atomic(self.path, self.data)


def now() -> str:
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
    # a field newer than the manifest ran at its default there
    defaults = EvaluateConfig().to_dict()
    diffs += [f"evaluate.{k} {old_evaluate.get(k, defaults.get(k))!r} -> {v!r}" for k, v in new["evaluate"].items()
              if old_evaluate.get(k, defaults.get(k)) != v and (searches or k not in SEARCH_ONLY_FIELDS)]
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
