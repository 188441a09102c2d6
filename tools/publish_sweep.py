"""Copy a sweep's per-cell results (not the checkpoints or ONNX files) into a directory under
reports/, then regenerate its comparison report, findings and plots there, so the committed
directory holds everything the findings need and `quantnorm compare` / `quantnorm findings` on it
reproduce its committed files byte for byte (tests/test_reports.py checks that).

Run:  python tools/publish_sweep.py SWEEP_DIR reports/NAME
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# train_log.jsonl: step 0's per-block (FFN) gradient norms are claim 2's data
# cell.json: the configuration the cell's recorded command (quantnorm evaluate --config) reads
KEEP_PER_CELL = ("results.json", "report.md", "train.json", "config.json", "train_log.jsonl", "cell.json")


def main(sweep: str, dest: str) -> int:
    src, out = Path(sweep), Path(dest)
    if not (src / "report.md").is_file():
        print(f"{src} has no report.md: run `quantnorm compare {src}` first")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in ("sweep.json",):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    # every finished cell, a diverged one (train.json, no results.json) included: its status is a result
    for cell in sorted(p for p in src.iterdir() if (p / "results.json").is_file() or (p / "train.json").is_file()):
        target = out / "cells" / cell.name
        target.mkdir(parents=True, exist_ok=True)
        for name in KEEP_PER_CELL:
            if (cell / name).is_file():
                shutil.copy2(cell / name, target / name)
        if (cell / "plots").is_dir():
            shutil.copytree(cell / "plots", target / "plots", dirs_exist_ok=True)
    # regenerate from the published cells: the committed report must be what `quantnorm compare` on
    # the committed directory writes (its name and its cells/ layout included)
    from quantnorm.report import write_comparison, write_findings

    write_comparison(out)
    write_findings(out)
    print(f"published {src} -> {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
