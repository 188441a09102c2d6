"""A stopped run leaves nothing half-written: SIGTERM unwinds (atomic writes drop their temporary
files, the FP32 outputs cache its folder) and exits 143; what a SIGKILL could not clean up is swept
at the next run's start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantnorm.cli import main
from quantnorm.fileio import sweep_stale_temporaries

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
EVALUATE = ["evaluate", "--quiet", "--recipes", "dynamic", "--calib-samples", "4", "--iters", "2", "--batches", "1",
            "--no-outliers", "--no-generation"]
LEFTOVERS = (".model.fp32.onnx.", ".fp32-outputs-")


def _quantnorm(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantnorm.cli", *args]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny trained run, trained in this process: only the runs that get a signal need their own."""
    run = tmp_path_factory.mktemp("interrupt") / "run"
    assert main(["train", "--placement", "pre", "--norm", "rms", "--steps", "3", "--layers", "1", "--d-model", "32",
                 "--heads", "2", "--context", "32", "--out", str(run), "--quiet"]) == 0
    return run


def _stop_when(run: Path, prefix: str, sig: int) -> subprocess.CompletedProcess:
    """Start an evaluate of ``run``, send ``sig`` once a file starting with ``prefix`` appears."""
    proc = subprocess.Popen(_quantnorm(*EVALUATE, "--checkpoint", str(run)), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not any(p.name.startswith(prefix) for p in run.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, f"{prefix} never appeared"
        time.sleep(0.02)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("moment", [".model.fp32.onnx.", ".fp32-outputs-"])
def test_sigterm_leaves_nothing_half_written(trained, moment):
    # so the export runs again and its temporary file can be caught, whatever ran before (random order)
    for earlier in ("model.fp32.onnx", "results.json"):
        (trained / earlier).unlink(missing_ok=True)
    done = _stop_when(trained, moment, signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "terminated (SIGTERM)" in done.stderr and "Traceback" not in done.stderr
    assert not [p.name for p in trained.iterdir() if p.name.startswith(LEFTOVERS)]
    assert not (trained / "results.json").exists()


# A signal whose handler runs inside a weakref callback: Python drops the exception raised there
# (as it does in any finalizer or gc callback), so the run must be told again, in ordinary code.
SIGNAL_IN_A_CALLBACK = """
import os, signal, time, weakref
from quantnorm.cli import Terminated, _sigterm_raises
SIGNUM, RAISED = signal.{signal}, {exception}

class Held:
    pass

def callback(ref):
    os.kill(os.getpid(), SIGNUM)
    sum(range(1000))   # the handler runs here, in the callback, and its exception is dropped

with _sigterm_raises():
    try:
        held = Held()
        ref = weakref.ref(held, callback)
        del held
        for _ in range(300):   # 3 s
            time.sleep(0.01)
        print("went on")
    except RAISED:
        print("stopped")
"""


@pytest.mark.parametrize("name, exception", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_signal_dropped_in_a_callback_is_sent_again(name, exception):
    script = SIGNAL_IN_A_CALLBACK.format(signal=name, exception=exception)
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "stopped", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_the_next_run_sweeps_what_a_sigkill_left(trained):
    done = _stop_when(trained, ".fp32-outputs-", signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    left = [p.name for p in trained.iterdir() if p.name.startswith(LEFTOVERS)]
    assert left  # nothing can clean up after SIGKILL ...
    assert main([*EVALUATE, "--checkpoint", str(trained)]) == 0   # the next run, here in this process
    assert not [p.name for p in trained.iterdir() if p.name.startswith(LEFTOVERS)]  # ... the next run does
    assert (trained / "results.json").is_file()


def test_sweep_removes_what_a_dead_process_left_and_nothing_of_a_live_one(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    old_file = tmp_path / f".model.fp32.onnx.{dead_pid}-abc123.onnx.tmp"
    old_dir = tmp_path / f".fp32-outputs-{dead_pid}-xyz"
    live_file = tmp_path / f".results.json.{live_pid}-def456.tmp"
    live_dir = tmp_path / f".fp32-outputs-{live_pid}-uvw"
    unnamed_old = tmp_path / ".report.md.ghi789.tmp"     # no PID in its name: judged by its age
    unnamed_new = tmp_path / ".report.md.jkl012.tmp"
    keep = tmp_path / "model.fp32.onnx"
    for path in (old_file, live_file, unnamed_old, unnamed_new, keep):
        path.write_text("x")
    for folder in (old_dir, live_dir):
        folder.mkdir()
        (folder / "0.npy").write_text("x")
    past = time.time() - 3600
    for path in (unnamed_old, keep):
        os.utime(path, (past, past))
    removed = sweep_stale_temporaries(tmp_path, older_than=time.time() - 60)
    assert sorted(p.name for p in removed) == sorted([old_file.name, old_dir.name, unnamed_old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live_file.name, live_dir.name, unnamed_new.name, keep.name])
    assert sweep_stale_temporaries(tmp_path / "missing", older_than=time.time()) == []
