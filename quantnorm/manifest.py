"""A sweep directory's manifest, ``sweep.json``: its file name, format version and reader.

Written by ``quantnorm.sweep`` and read by ``compare`` (which cells the sweep listed) and
``gate`` (a failed cell must fail the gate). It sits below all three so that neither reader has
to import the sweep, which imports the whole pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import RunDirError

MANIFEST_FILE = "sweep.json"
# 2: ``settings`` holds the evaluate configuration serialized (``settings.evaluate``, the fields of
# EvaluateConfig) instead of version 1's re-spelled evaluate flags beside the axes, and each cell's
# entry its ``config`` (the RunConfig and EvaluateConfig it ran with). What compare and gate read
# (``cells``, ``commands``, the training flags in ``settings``) is the same in both; the sweep
# resumes a version-1 directory by reading its flags into an EvaluateConfig (sweep.previous_settings).
MANIFEST_VERSION = 2


def read_manifest(out_dir: Path) -> dict | None:
    path = Path(out_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc}); delete it to start the sweep's manifest afresh") from None
    if not isinstance(data, dict) or "settings" not in data:
        raise RunDirError(f"{path} is not a quantnorm sweep manifest; use another --out")
    return data
