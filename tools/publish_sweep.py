"""Copy a sweep's report, plots and per-cell results.json (not the checkpoints or ONNX files)
into a directory under reports/, so the reference report can be committed.

Run:  python tools/publish_sweep.py SWEEP_DIR reports/NAME
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

KEEP_PER_CELL = ("results.json", "report.md", "train.json", "config.json")


def main(sweep: str, dest: str) -> int:
    src, out = Path(sweep), Path(dest)
    if not (src / "report.md").is_file():
        print(f"{src} has no report.md: run `quantnorm compare {src}` first")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "findings.md", "sweep.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if (src / "plots").is_dir():
        shutil.copytree(src / "plots", out / "plots", dirs_exist_ok=True)
    for cell in sorted(p for p in src.iterdir() if (p / "results.json").is_file()):
        target = out / "cells" / cell.name
        target.mkdir(parents=True, exist_ok=True)
        for name in KEEP_PER_CELL:
            if (cell / name).is_file():
                shutil.copy2(cell / name, target / name)
        if (cell / "plots").is_dir():
            shutil.copytree(cell / "plots", target / "plots", dirs_exist_ok=True)
    print(f"published {src} -> {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
