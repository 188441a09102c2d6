"""`quantnorm sweep`: a tiny real sweep killed with SIGKILL mid-run and resumed (the DoD), skipping
of finished cells, failure and divergence bookkeeping, bad input, and the Ray executor.

Real cells are the smallest model on a 40 kB corpus (a cell is a process: most of its time is
starting Python and the export); the bookkeeping tests replace the cell process with a stub that writes a synthetic results.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_compare import make_results

from quantnorm import sweep as sweep_mod
from quantnorm.cli import main
from quantnorm.config import EvaluateConfig
from quantnorm.results import load as load_results
from quantnorm.sweep import CELL_CONFIG_FILE, MANIFEST_FILE, Cell, SweepConfig, cell_status
from quantnorm.train import RunConfig

# --min-top1, --max-kld and --search-pick only steer --recipes auto; given here, they must still
# reach every cell's configuration (the sweep hands each cell the EvaluateConfig it was given)
TINY = ["--norms", "rms", "--seeds", "1", "--depths", "1", "--d-model", "32", "--heads", "2", "--context", "32",
        "--steps", "8", "--batch-size", "8", "--batches", "1", "--iters", "2", "--calib-samples", "8",
        "--recipes", "dynamic", "--providers", "cpu", "--no-outliers", "--min-top1", "0.5", "--max-kld", "0.5",
        "--search-pick", "first", "--jobs", "1"]
CELLS = ["pre-rms-L1-w2-seed0", "peri-rms-L1-w2-seed0"]


def _sweep_args(out: Path, corpus: Path, placements: str = "pre,peri") -> list[str]:
    return ["sweep", "--placements", placements, *TINY, "--corpus", str(corpus), "--out", str(out), "--quiet"]


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, small_corpus):
    """Start a real 2-cell sweep in its own process group, SIGKILL the group once the first cell
    has finished and the second is training, then run the same command again (in-process)."""
    out = tmp_path_factory.mktemp("sweep") / "s"
    first, second = (out / c for c in CELLS)
    proc = subprocess.Popen([sys.executable, "-m", "quantnorm.cli", *_sweep_args(out, small_corpus)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if cell_status(first) == "done" and (second / "config.json").exists():
                break
            time.sleep(0.1)
        state = {"first_done": cell_status(first) == "done", "second_started": (second / "config.json").exists(),
                 "still_running": proc.poll() is None}
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:   # the sweep ended first (state["still_running"] says so): the test fails on it
            pass
    finally:
        proc.wait(timeout=30)
    state["second_results_before"] = (second / "results.json").exists()
    state["first_mtime"] = (first / "results.json").stat().st_mtime_ns if state["first_done"] else None
    state["stderr"] = proc.stderr.read().decode(errors="replace")[-2000:]
    t0 = time.monotonic()
    state["resume_rc"] = main(_sweep_args(out, small_corpus))
    state["resume_s"] = time.monotonic() - t0
    return out, state


def test_sigkill_mid_sweep_then_resume_finishes_every_cell(killed_and_resumed):
    out, state = killed_and_resumed
    assert state["first_done"] and state["second_started"] and state["still_running"], state
    assert not state["second_results_before"]          # killed in flight
    assert state["resume_rc"] == 0
    for name in CELLS:
        results = json.loads((out / name / "results.json").read_text())   # valid JSON
        assert load_results(out / name)["model"]["placement"] == name.split("-")[0]
        acc = results["recipes"][0]["accuracy"]
        assert acc["ppl_ratio"] == pytest.approx(1.0, abs=0.05) and 0 < acc["kld_mean"] < 0.05, acc
        assert (out / name / "evaluate.log").is_file()
    # the finished cell was not redone; no temporary of an interrupted atomic write is left
    assert (out / CELLS[0] / "results.json").stat().st_mtime_ns == state["first_mtime"]
    assert _temporaries(out) == []
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert {k: v["status"] for k, v in manifest["cells"].items()} == {CELLS[0]: "done", CELLS[1]: "done"}


def test_a_real_cell_runs_from_its_cell_json(killed_and_resumed):
    """Each cell's process was `quantnorm evaluate --config <cell>/cell.json`: the file holds the
    cell's RunConfig and the sweep's EvaluateConfig (with the executor's thread share), the
    manifest records the same, and the trained model is the one the file describes."""
    out, _ = killed_and_resumed
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["sweep_version"] == 2
    for name in CELLS:
        config = json.loads((out / name / CELL_CONFIG_FILE).read_text())
        assert manifest["cells"][name]["config"] == config
        evaluate = EvaluateConfig.from_dict(config["evaluate"])
        assert (evaluate.min_top1, evaluate.max_kld, evaluate.search_pick) == (0.5, 0.5, "first")
        assert evaluate.threads == sweep_mod.available_cores()   # --jobs 1: all cores to the one cell
        assert {**config["evaluate"], "threads": None} == manifest["settings"]["evaluate"]
        results = load_results(out / name)
        assert results["command"].startswith("quantnorm evaluate --config ") and CELL_CONFIG_FILE in results["command"]
        run = RunConfig.from_dict(config["run"])
        assert results["train"]["config"] == config["run"]["train"] and results["model"]["d_model"] == run.model.d_model


def test_resumed_sweep_writes_the_comparison_report(killed_and_resumed):
    out, _ = killed_and_resumed
    report = (out / "report.md").read_text()
    for text in ("pre/rms", "peri/rms", "## Training status", "## Ranking", "## Findings", "Summary: claim 1"):
        assert text in report, text
    # 8 training steps leave both cells on the unigram plateau (60 steps of a wider model do not
    # leave it: tests/test_train.py): each is named collapsed and left out of the tables; reports
    # with trained cells are tests/test_compare.py's
    assert "0 of 2 cells trained, 2 collapsed" in report and "Left out (2)" in report
    for name in CELLS:
        assert f"`{name}` (collapsed" in report, name


def test_rerun_skips_finished_cells(killed_and_resumed, small_corpus, capsys):
    out, _ = killed_and_resumed
    mtimes = {c: (out / c / "results.json").stat().st_mtime_ns for c in CELLS}
    capsys.readouterr()
    assert main(_sweep_args(out, small_corpus)) == 0
    text = capsys.readouterr().out
    assert "2 of 2 cells already finished, skipped" in text and "2 skipped" in text
    assert {c: (out / c / "results.json").stat().st_mtime_ns for c in CELLS} == mtimes


# ------------------------------------------------------------------ bookkeeping (stubbed cells)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _stub_cell(behaviour: dict[str, str]):
    """A stand-in for run_cell_process: per placement, "ok" writes a synthetic results.json,
    "fail" writes a traceback-like log and exits 1, "diverge" writes a diverged train.json."""
    calls, configs = [], []

    def run(args, log_path, env, cell=None, config=None):
        out = Path(_arg(args, "--out"))
        assert args == sweep_mod.cell_args(out)   # the process gets its configuration from cell.json only
        model, train = config["run"]["model"], config["run"]["train"]
        placement = model["placement"]
        calls.append((placement, env.get("OMP_NUM_THREADS")))
        configs.append(config)
        Path(log_path).write_text("$ quantnorm evaluate ...\nTraceback (most recent call last):\nboom: cell exploded\n")
        what = behaviour[placement]
        if what == "ok":
            r = make_results(placement, model["norm"], train["seed"], depth=model["n_layers"], warmup=train["warmup"],
                             recipes=("dynamic",))
            (out / "results.json").write_text(json.dumps(r))
            return 0
        if what == "diverge":
            (out / "config.json").write_text(json.dumps({"model": {"placement": placement, "norm": "rms",
                                                                   "n_layers": 1},
                                                         "train": {"warmup": 2, "seed": 0}}))
            (out / "train.json").write_text(json.dumps({"diverged": True, "diverged_at": 3}))
            return 2
        return 1

    run.configs = configs
    return run, calls


def test_a_failing_cell_is_recorded_and_the_others_go_on(tmp_path, small_corpus, monkeypatch, capsys):
    run, calls = _stub_cell({"pre": "fail", "peri": "ok", "post": "diverge"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run)
    out = tmp_path / "s"
    assert main(_sweep_args(out, small_corpus, "pre,peri,post")) == 1
    err = capsys.readouterr().err
    assert "failed: pre-rms-L1-w2-seed0 (exit code 1): boom: cell exploded" in err
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    cells = manifest["cells"]
    assert cells["pre-rms-L1-w2-seed0"]["status"] == "failed" and cells["pre-rms-L1-w2-seed0"]["rc"] == 1
    assert cells["pre-rms-L1-w2-seed0"]["log_tail"][-1] == "boom: cell exploded"
    assert cells["peri-rms-L1-w2-seed0"]["status"] == "done"
    assert cells["post-rms-L1-w2-seed0"]["status"] == "diverged"   # a result, not a failure
    assert len(calls) == 3 and {t for _, t in calls} == {str(sweep_mod.available_cores())}   # --jobs 1: all cores
    report = (out / "report.md").read_text()
    assert "pre-rms-L1-w2-seed0` failed (exit code 1)" in report
    assert "`post-rms-L1-w2-seed0` (diverged)" in report   # post diverged: named, left out of the effects
    # the rerun redoes only the failed cell; when it passes, the sweep exits 0
    run2, calls2 = _stub_cell({"pre": "ok", "peri": "fail", "post": "fail"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run2)
    assert main(_sweep_args(out, small_corpus, "pre,peri,post")) == 0
    assert [p for p, _ in calls2] == ["pre"]


def test_a_grown_sweep_records_every_invocation_in_order(tmp_path, small_corpus, monkeypatch):
    """Axes grown by a second invocation: the manifest keeps both commands (a resume of the first
    moves it to the end) and the report lists them all, so the directory can be reproduced."""
    run, _ = _stub_cell({"pre": "ok", "peri": "ok"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run)
    out = tmp_path / "s"
    first, second = _sweep_args(out, small_corpus, "pre"), _sweep_args(out, small_corpus, "peri")
    assert main(first) == 0 and main(second) == 0
    commands = json.loads((out / MANIFEST_FILE).read_text())["commands"]
    assert len(commands) == 2 and "--placements pre " in commands[0] and "--placements peri " in commands[1]
    report = (out / "report.md").read_text()
    assert "grown by 2 invocations" in report and f"1. `{commands[0]}`" in report and f"2. `{commands[1]}`" in report
    assert main(first) == 0  # resuming the first moves it last: the order they must run in to reproduce
    assert json.loads((out / MANIFEST_FILE).read_text())["commands"] == [commands[1], commands[0]]


def test_a_corrupt_results_json_is_redone(tmp_path, small_corpus, monkeypatch):
    run, calls = _stub_cell({"pre": "ok", "peri": "ok"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run)
    out = tmp_path / "s"
    (out / CELLS[0]).mkdir(parents=True)
    (out / CELLS[0] / "results.json").write_text('{"schema_version": 1, "model": ')   # half a file
    assert main(_sweep_args(out, small_corpus)) == 0
    assert sorted(p for p, _ in calls) == ["peri", "pre"]
    assert cell_status(out / CELLS[0]) == "done"


def test_a_cell_another_process_holds_is_waited_for_and_not_run_twice(tmp_path):
    """A sweep killed alone leaves its cell processes running (they hold the cell's lock); a
    restarted sweep waits for them and does not run the cell again into the same directory."""
    import fcntl
    import threading

    cell = Cell("pre", "rms", 1, 2, 0)
    cell_dir = tmp_path / cell.name
    cell_dir.mkdir()
    log = cell_dir / "evaluate.log"
    holder = open(cell_dir / ".cell.lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(rc=sweep_mod.run_cell_process(["--version"], str(log), {},
                                                                                         cell)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not log.exists()          # waiting, and the other process's log is untouched
    (cell_dir / "results.json").write_text(json.dumps(make_results("pre", "rms", 0, depth=1, warmup=2)))
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    waiter.join(60)
    assert result == {"rc": 0} and not log.exists()        # finished by the other process: not run again
    (cell_dir / "results.json").unlink()
    (cell_dir / ".config.json.x.tmp").write_text("partial")
    assert sweep_mod.run_cell_process(["--version"], str(log), {}, cell) == 0
    assert "version" in log.read_text() and not (cell_dir / ".config.json.x.tmp").exists()


@pytest.mark.parametrize("args, message", [
    (["--placements", "sandwich"], "unknown placement 'sandwich'"),
    (["--placements", "pre", "--norms", "batch"], "unknown norm 'batch'"),
    (["--placements", "pre", "--seeds", "0"], "--seeds"),
    (["--placements", "pre", "--seeds", "-2"], "--seeds"),
    (["--placements", ","], "no placements given"),
    (["--placements", "pre", "--norms", ""], "no norms given"),
    (["--placements", "pre", "--depths", "0"], "--depths"),
    (["--placements", "pre", "--warmups", "-1"], "--warmups"),
    (["--placements", "pre", "--warmups", "x"], "--warmups"),
    (["--placements", "pre", "--lrs", "0,1e-3"], "--lrs"),
    (["--placements", "pre", "--lrs", "fast"], "--lrs"),
    (["--placements", "pre", "--recipes", "nope"], "nope"),
    (["--placements", "pre", "--d-model", "30", "--heads", "4"], "not divisible"),
    (["--placements", "pre", "--steps", "10", "--warmups", "50"], "warmup"),
    (["--placements", "pre", "--corpus", "MISSING"], "corpus not found"),
    (["--placements", "pre", "--out", "FILE"], "existing file"),
    (["--placements", "pre", "--jobs", "0"], "--jobs"),
    (["--placements", "pre", "--ray-address", "auto"], "--ray-address needs --executor ray"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("not a directory")
    before = sorted(p.name for p in tmp_path.iterdir())
    full = ["sweep", "--out", "sweepdir", "--quiet", *args] if "--out" not in args else ["sweep", "--quiet", *args]
    assert main(full) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_lrs_is_an_axis_of_cells_named_by_their_rate():
    cfg = SweepConfig(placements=("post", "pre"), norms=("rms",), seeds=2, lrs=(1e-3, 3e-3), steps=10)
    cells = cfg.cells()
    assert len(cells) == 8 and cells[0].name == "post-rms-L4-w2-lr0.001-seed0"
    assert {c.run_config(cfg).train.lr for c in cells} == {1e-3, 3e-3}
    assert cells[0].config(cfg, None)["run"]["train"]["lr"] == 0.001
    assert SweepConfig(seeds=1).cells()[0].name == "post-layer-L4-w30-seed0"   # no --lrs: names unchanged


def test_resuming_with_other_settings_is_refused(tmp_path, small_corpus, capsys):
    out = tmp_path / "s"
    out.mkdir()
    old = SweepConfig(placements=("pre",), norms=("rms",), seeds=1, steps=99)
    (out / MANIFEST_FILE).write_text(json.dumps({"sweep_version": 2, "settings": old.to_dict(), "cells": {}}))
    assert main(_sweep_args(out, small_corpus)) == 2
    err = capsys.readouterr().err.strip()
    assert "other settings" in err and "steps 99 -> 8" in err and len(err.splitlines()) == 1
    assert "evaluate.latency_iters 30 -> 2" in err
    # the search's targets differ too (0.95 -> 0.5), but neither sweep searches: not a difference
    assert "min_top1" not in err


def test_search_targets_count_only_where_a_sweep_searches(tmp_path):
    from quantnorm.config import EvaluateConfig

    old = SweepConfig(placements=("pre",), norms=("rms",), seeds=1).to_dict()
    for recipes, counted in ((("dynamic",), False), (("dynamic", "auto"), True)):
        old["evaluate"]["recipes"] = list(recipes)
        new = SweepConfig(placements=("pre",), norms=("rms",), seeds=1,
                          evaluate=EvaluateConfig(recipes=recipes, min_top1=0.5))
        manifest = {"sweep_version": 2, "settings": old, "cells": {}}
        if counted:
            with pytest.raises(sweep_mod.ConfigError, match=r"evaluate.min_top1 0.95 -> 0.5"):
                sweep_mod.check_compatible(manifest, new, tmp_path)
        else:
            sweep_mod.check_compatible(manifest, new, tmp_path)


def test_ray_missing_is_a_clear_one_line_error(tmp_path, small_corpus, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray -> ImportError
    assert main([*_sweep_args(tmp_path / "s", small_corpus), "--executor", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --executor ray needs Ray, which is not installed: pip install 'quantnorm[ray]'"
    assert not (tmp_path / "s").exists()


def test_ray_sweep_reports_a_killed_cell_failed_and_resumes_it(tmp_path, small_corpus):
    """--executor ray for real: a local Ray instance started here (2 CPUs, no dashboard), the sweep
    driver is the CLI in its own process pointed at it with --ray-address (as at a cluster). One
    cell's `quantnorm evaluate` process is SIGKILLed mid-run, found by the PID file the cell writes:
    that cell is reported failed while the other completes; the same command then resumes and
    finishes the killed cell, the finished one untouched (Ray task retries are off: the resume is
    the recovery). The resume runs in this process, whose Ray is the one the first driver reached
    by address: the address path is the first run's, the resume's subject is the bookkeeping. Ray
    is the `ray` extra, which .ci/run installs: a skip there fails CI."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        out = tmp_path / "s"
        tiny = TINY[: TINY.index("--jobs")]  # no --jobs: both cells as Ray tasks at once, 1 CPU each
        argv = [sys.executable, "-m", "quantnorm.cli", "sweep", "--placements", "pre,peri", *tiny,
                "--corpus", str(small_corpus), "--out", str(out), "--quiet", "--threads", "1",
                "--executor", "ray", "--ray-address", address]
        survivor, victim = (out / c for c in CELLS)
        pid_file = victim / sweep_mod.CELL_PID_FILE
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # A deadline for a failure only (the loop ends when training starts, 10-20 s in): on 2
        # loaded cores a Ray worker and the cell's imports took over 120 s once.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (
                pid_file.exists() and (victim / "config.json").exists()):  # training has started
            time.sleep(0.05)
        assert pid_file.exists(), f"the cell never started: {proc.poll()}"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 1, stdout + stderr  # a failed cell: exit code 1, the others still ran
        assert f"failed: {CELLS[1]} (exit code -9)" in stderr, stderr
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        assert {k: v["status"] for k, v in manifest["cells"].items()} == {CELLS[0]: "done", CELLS[1]: "failed"}
        assert manifest["executor"] == "ray" and manifest["ray"]["address"] == address
        assert load_results(survivor)["model"]["placement"] == "pre" and not (victim / "results.json").exists()
        finished = (survivor / "results.json").stat().st_mtime_ns

        assert main(argv[3:]) == 0   # the same command
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        assert {k: v["status"] for k, v in manifest["cells"].items()} == {CELLS[0]: "done", CELLS[1]: "done"}
        assert load_results(victim)["model"]["placement"] == "peri"
        assert (survivor / "results.json").stat().st_mtime_ns == finished  # not redone
        assert not list(out.rglob(sweep_mod.CELL_PID_FILE)) and _temporaries(out) == []
        assert (out / "report.md").is_file()
    finally:
        ray.shutdown()



# ------------------------------------------------------- one serialized configuration per cell

# Every evaluate flag away from its default (--recipes auto so that the search flags mean something)
EVALUATE_FLAGS = ["--recipes", "auto,dynamic", "--sq-alpha", "0.3", "--max-ppl-ratio", "1.05", "--min-top1", "0.9",
                  "--max-kld", "0.02", "--search-space", "dynamic,static-minmax-matmul", "--search-pick", "first",
                  "--providers", "cpu", "--calib-samples", "5", "--exclude", "head/*", "--exclude", "blocks.0.*",
                  "--opset", "23", "--opt-level", "basic", "--batches", "2,4", "--iters", "3", "--no-outliers",
                  # generation's default differs (on for evaluate, off for a sweep): given, both take it
                  "--generation", "--gen-batches", "1,2", "--gen-tokens", "16,8", "--agreement", "4,8"]


def _evaluate_config_of_flags(monkeypatch, flags: list[str]) -> tuple:
    """The (RunConfig, EvaluateConfig) that `quantnorm evaluate FLAGS` hands the pipeline."""
    from quantnorm import cli

    seen = {}
    run_dir = type("RunDir", (), {"path": Path("run")})()
    monkeypatch.setattr(cli, "ensure_trained", lambda run, out, data, progress: seen.update(run=run) or run_dir)
    monkeypatch.setattr(cli, "run_evaluate", lambda run_dir, cfg, command: seen.update(cfg=cfg) or {"recipes": []})
    monkeypatch.setattr(cli, "prepare_data", lambda data, context: None)
    assert main(["evaluate", *flags]) == 0
    return seen.get("run"), seen["cfg"]


def test_every_evaluate_flag_is_a_sweep_flag():
    from quantnorm import cli, cli_flags

    sweep_params = {p.name: p for p in cli.sweep.params}
    evaluate_params = {p.name: p for p in cli.evaluate.params}
    for name in cli_flags.EVALUATE_FLAGS:   # one option list, so the same flag, type, default and help
        assert sweep_params[name].opts == evaluate_params[name].opts and sweep_params[name].help == \
            evaluate_params[name].help, name
    assert {"exclude", "min_top1", "max_kld", "search_pick", "search_space", "max_ppl_ratio", "sq_alpha"} <= set(
        cli_flags.EVALUATE_FLAGS)
    train_params = {p.opts[0]: p for p in cli.train.params}
    for flag in cli.SWEEP_TRAINING_FLAGS:   # the training flags a sweep shares, spelled as train's
        (param,) = [p for p in cli.sweep.params if p.opts == [flag]]
        assert param.help == train_params[flag].help and param.default == train_params[flag].default, flag


def test_a_sweep_cell_gets_exactly_the_evaluate_config_of_the_same_flags(tmp_path, small_corpus, monkeypatch):
    run, _ = _stub_cell({"pre": "ok"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run)
    out = tmp_path / "s"
    assert main(["sweep", "--placements", "pre", *TINY[: TINY.index("--batches")], *EVALUATE_FLAGS,
                 "--threads", "2", "--jobs", "1", "--corpus", str(small_corpus), "--out", str(out), "--quiet"]) == 0
    (config,) = run.configs
    _, expected = _evaluate_config_of_flags(monkeypatch, ["--placement", "pre", "--norm", "rms", *EVALUATE_FLAGS,
                                                          "--threads", "2", "--quiet"])
    got = EvaluateConfig.from_dict(config["evaluate"])
    assert got == expected
    assert got.exclude == ("head/*", "blocks.0.*") and (got.min_top1, got.max_kld, got.search_pick) == (0.9, 0.02,
                                                                                                      "first")
    assert got.graph_optimization_level == "basic" and got.search_space == ("dynamic", "static-minmax-matmul")
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["settings"]["evaluate"] == expected.to_dict()
    assert manifest["cells"]["pre-rms-L1-w2-seed0"]["config"] == config


def test_evaluate_config_file_is_what_the_pipeline_gets(tmp_path, monkeypatch, capsys):
    cfg = SweepConfig(placements=("post",), norms=("layer",), seeds=1, steps=12, d_model=32, heads=2, context=16,
                      evaluate=EvaluateConfig(recipes=("dynamic",), exclude=("head/*",), min_top1=0.9, threads=1))
    cell = cfg.cells()[0]
    path = tmp_path / CELL_CONFIG_FILE
    path.write_text(json.dumps(cell.config(cfg, None)))
    run, got = _evaluate_config_of_flags(monkeypatch, ["--config", str(path), "--out", str(tmp_path / "run")])
    assert run == cell.run_config(cfg) and run.train.warmup == 3       # the warm-up rule, written once
    assert got == cfg.evaluate
    capsys.readouterr()
    # beside --config, a training or evaluate flag would be ignored: refused instead
    assert main(["evaluate", "--config", str(path), "--recipes", "dynamic", "--layers", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --config holds the whole configuration: drop --layers, --recipes", err
    bad = json.loads(path.read_text())
    bad["evaluate"]["opt_level"] = "all"    # v1's spelling of graph_optimization_level
    path.write_text(json.dumps(bad))
    assert main(["evaluate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown key 'opt_level'" in err and str(path) in err and len(err.splitlines()) == 1


def _v1_settings(**overrides) -> dict:
    """The settings of a version-1 sweep.json for the TINY flags (evaluate flags re-spelled flat)."""
    return {"placements": ["pre", "peri"], "norms": ["rms"], "seeds": 1, "warmups": None, "depths": [1], "d_model": 32,
            "heads": 2, "context": 32, "steps": 8, "batch_size": 8, "lr": 0.003, "corpus": None,
            "recipes": ["dynamic"], "providers": ["cpu"], "calib_samples": 8, "opset": 18, "opt_level": "all",
            "threads": None, "batches": [1], "iters": 2, "outliers": False, "sq_alpha": None, **overrides}


def test_a_version_1_sweep_resumes_with_the_same_flags_and_refuses_other_ones(tmp_path, small_corpus, monkeypatch,
                                                                             capsys):
    """A version-1 manifest's flags read as the EvaluateConfig its cells ran with (the flags v1 did
    not pass at evaluate's defaults): the same flags resume it, other ones are refused naming the field."""
    run, calls = _stub_cell({"pre": "ok", "peri": "ok"})
    monkeypatch.setattr(sweep_mod, "run_cell_process", run)
    out = tmp_path / "s"
    out.mkdir()
    v1 = {"sweep_version": 1, "command": "quantnorm sweep ...", "settings": _v1_settings(corpus=str(small_corpus)),
          "cells": {}}
    (out / MANIFEST_FILE).write_text(json.dumps(v1))
    tiny = [a for a in TINY if a not in ("--min-top1", "0.5", "--max-kld", "--search-pick", "first")]  # v1: not passed
    args = ["sweep", "--placements", "pre,peri", *tiny, "--corpus", str(small_corpus), "--out", str(out), "--quiet"]
    assert main([*args[:-1], "--opt-level", "basic", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "evaluate.graph_optimization_level 'all' -> 'basic'" in err and len(err.strip().splitlines()) == 1
    assert main(args) == 0 and len(calls) == 2
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["sweep_version"] == 2 and manifest["commands"][0] == "quantnorm sweep ..."
    assert "opt_level" not in manifest["settings"] and manifest["settings"]["evaluate"]["latency_iters"] == 2


def test_a_manifest_of_a_newer_version_is_refused(tmp_path, small_corpus, capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / MANIFEST_FILE).write_text(json.dumps({"sweep_version": 3, "settings": {}, "cells": {}}))
    assert main(_sweep_args(out, small_corpus)) == 2
    assert "sweep_version 3; this quantnorm reads versions 1 to 2" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["reference", "zoo"])
def test_a_committed_sweep_is_compatible_with_its_recorded_commands(name, monkeypatch):
    """reports/<name>/sweep.json (version 2) would resume with each command that grew it."""
    import shlex

    from quantnorm import cli

    root = Path(__file__).resolve().parents[1] / "reports" / name
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    assert manifest["sweep_version"] == 2
    built = []
    monkeypatch.setattr(cli, "run_sweep", lambda cfg, out, **kw: built.append(cfg) or
                        sweep_mod.SweepOutcome(Path(out), [], None))
    for command in manifest.get("commands") or [manifest["command"]]:
        assert main(shlex.split(command)[1:]) == 0
        sweep_mod.check_compatible(manifest, built[-1], root)     # raises ConfigError on any difference
    settings = manifest["settings"]
    recorded = settings["recipes"] if manifest["sweep_version"] == 1 else settings["evaluate"]["recipes"]
    assert built[-1].evaluate.recipes == tuple(recorded)
