"""Run directories: one directory holds everything a run produced.

Layout of ``runs/<name>/``::

    config.json          model, training and data configuration, and its hash
    model.safetensors    the trained weights
    train_log.jsonl      one JSON object per training step
    train.json           the training summary; written last, so its presence means "trained"
    model.fp32.onnx, model.int8.<recipe>.onnx, results.json, report.md, plots/

A stage reuses what an earlier one wrote when the stored config hash matches its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RunDirError

CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "model.safetensors"
TRAIN_LOG_FILE = "train_log.jsonl"
TRAIN_SUMMARY_FILE = "train.json"
FP32_ONNX_FILE = "model.fp32.onnx"
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
PLOTS_DIR = "plots"


def int8_onnx_file(recipe: str) -> str:
    return f"model.int8.{recipe}.onnx"


PAST_SUFFIX = ".past"   # the with-past (KV-cache) twin of a graph: ``model.fp32.onnx`` -> ``model.fp32.past.onnx``


def past_file(name: str) -> str:
    """The with-past twin of the ONNX file ``name``."""
    return name[: -len(".onnx")] + PAST_SUFFIX + ".onnx" if name.endswith(".onnx") else name + PAST_SUFFIX


def past_onnx_file(name: str) -> str:
    """The with-past (KV-cache) graph of the FP32 model (``name`` "fp32") or of a recipe; the
    search's pick ``auto:<recipe>`` is ``auto``, as its whole-window model."""
    return past_file(FP32_ONNX_FILE if name == "fp32" else int8_onnx_file(name.split(":", 1)[0]))


def config_hash(config: dict[str, Any]) -> str:
    """A short, stable hash of a JSON-able configuration (key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_out_dir(path: Path) -> Path:
    """An output directory must not be an existing file (checked before anything is written)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path} is an existing file: give a directory path")
    return path


@dataclass(frozen=True)
class RunDir:
    path: Path

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def is_trained(self) -> bool:
        return self.file(CONFIG_FILE).is_file() and self.file(CHECKPOINT_FILE).is_file() \
            and self.file(TRAIN_SUMMARY_FILE).is_file()

    def read_json(self, name: str) -> dict:
        path = self.file(name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RunDirError(f"{path} is missing: run `quantnorm train` (or `evaluate`) for this directory first") from None
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); delete the run and train again") from None

    def stored_hash(self) -> str | None:
        if not self.is_trained:
            return None
        return self.read_json(CONFIG_FILE).get("config_hash")


def open_run_dir(path: str | Path) -> RunDir:
    """Open an existing, trained run directory (for ``--checkpoint RUN_DIR`` and friends)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory: pass a run directory written by `quantnorm train`")
    run = RunDir(path)
    if not run.is_trained:
        raise RunDirError(
            f"{path} is not a trained run directory (needs {CONFIG_FILE}, {CHECKPOINT_FILE} and {TRAIN_SUMMARY_FILE}): "
            f"run `quantnorm train --out {path}` first"
        )
    return run
