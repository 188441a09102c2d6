"""Other engines beside quantnorm's rows (``quantnorm evaluate --engines``): llama.cpp, for real.

A tiny Llama GGUF (tests/gguf_helpers.py) goes through one ``evaluate --engines llamacpp``:
llama.cpp quantizes it with its own quantizer and runs each type; the engine stage scores each
against quantnorm's FP32 ONNX model. Nothing of llama.cpp is mocked; its absence is made by
hiding the ``llama_cpp`` module from the import system.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from gguf_helpers import write_tiny_llama_gguf

from quantnorm.cli import main
from quantnorm.engines import EngineRequest, NotMeasured, get_engine
from quantnorm.engines.llamacpp import NOT_GGUF, NOT_INSTALLED
from quantnorm.errors import ConfigError
from quantnorm.results import ResultsError, engine_rows, generation_models, validate

TYPES = ("F32", "Q8_0", "Q4_K_M", "Q4_0")
SMALL = ["--context", "16", "--eval-tokens", "160", "--calib-samples", "4", "--batches", "1", "--iters", "2",
         "--providers", "cpu", "--threads", "1", "--quiet", "--no-outliers", "--recipes", "dynamic"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "Tiny-Llama.F32.gguf", layers=1)


@pytest.fixture(scope="module")
def engine_run(tiny_gguf, tmp_path_factory) -> tuple[Path, dict]:
    """One evaluate of the tiny GGUF with llama.cpp's four default types beside one recipe."""
    out = tmp_path_factory.mktemp("engines") / "run"
    argv = ["evaluate", "--model", str(tiny_gguf), *SMALL, "--out", str(out), "--gen-tokens", "8,6",
            "--gen-batches", "1", "--agreement", "4,6", "--engines", "llamacpp", "--llamacpp-types", ",".join(TYPES)]
    assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def _rows(results: dict) -> dict[str, dict]:
    return {row["format"]: row for row in engine_rows(results)}


def test_every_type_is_a_measured_row_with_its_file_version_and_settings(engine_run):
    out, results = engine_run
    validate(results)
    assert results["engines"]["status"] == "ok"
    (group,) = results["engines"]["engines"]
    assert group["engine"] == "llamacpp" and group["version"] == "0.3.36"
    rows = _rows(results)
    assert list(rows) == list(TYPES)
    for fmt, row in rows.items():
        assert row["status"] == "ok", row
        assert (out / row["path"]).is_file() and (out / row["path"]).stat().st_size == row["size_bytes"]
        assert row["settings"]["ftype"] == fmt and row["settings"]["threads"] == 1
        assert row["settings"]["n_ctx"] >= 16
        assert row["accuracy"]["n_scored"] == results["recipes"][0]["accuracy"]["n_scored"]   # the same positions


def test_the_f32_dequantization_is_quantnorms_fp32_baseline(engine_run):
    acc = _rows(engine_run[1])["F32"]["accuracy"]
    assert acc["kld_mean"] < 1e-3 and acc["kld_max"] < 1e-2, acc
    assert acc["top1_agreement"] >= 0.99 and acc["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)


def test_fewer_bits_cost_more_and_weigh_less(engine_run):
    rows = _rows(engine_run[1])
    kl = {fmt: rows[fmt]["accuracy"]["kld_mean"] for fmt in TYPES}
    assert kl["F32"] < kl["Q8_0"] < kl["Q4_0"], kl
    sizes = [rows[fmt]["size_bytes"] for fmt in TYPES]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes), sizes


def test_agreement_has_the_recipes_statistics_and_speed_is_measured(engine_run):
    results = engine_run[1]
    recipe = next(m for m in generation_models(results) if m.name == "dynamic")
    for row in _rows(results).values():
        assert set(row["agreement"]) == set(recipe.agreement)
        assert row["agreement"]["prompts"] == 4 and row["agreement"]["new_tokens"] == 6
        assert 0 <= row["agreement"]["identical_before_divergence"] <= 1
        speed = row["speed"]
        assert speed["prompt_tokens"] == 8 and speed["new_tokens"] == 6 and speed["rounds"] >= 1
        assert speed["prompt_tok_s"] > 0 and speed["gen_tok_s"] > 0 and speed["token_ms_p50"] > 0
    assert _rows(results)["F32"]["agreement"]["identical_prompts"] == 4
    assert {f"engines:llamacpp:{fmt}" for fmt in TYPES} <= set(results["stage_seconds"])


def test_a_checkpoint_directory_is_not_measured_and_says_why(engine_run, tmp_path):
    """The GGUF run's dequantized checkpoint is a Hugging Face directory: llama.cpp reads GGUF files."""
    out = tmp_path / "hf"
    argv = ["evaluate", "--model", str(engine_run[0] / "checkpoint"), *SMALL, "--out", str(out), "--no-generation",
            "--engines", "llamacpp", "--llamacpp-types", "q8_0,Q4_0"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    validate(results)
    rows = engine_rows(results)
    assert [(r["format"], r["status"]) for r in rows] == [("Q8_0", "not measured: " + NOT_GGUF),
                                                          ("Q4_0", "not measured: " + NOT_GGUF)]


def test_without_llama_cpp_every_type_is_not_measured(monkeypatch, tmp_path, tiny_gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # `import llama_cpp` raises ImportError
    engine = get_engine("llamacpp")
    assert engine.available() == NOT_INSTALLED and "pip install 'quantnorm[llamacpp]'" in NOT_INSTALLED
    request = EngineRequest(checkpoint=tiny_gguf, checkpoint_kind="gguf", hf_dir=None, work_dir=tmp_path,
                            threads=1, max_length=32, formats=("Q8_0", "F32"))
    made = list(engine.models(request))
    assert made == [NotMeasured("llamacpp", "Q8_0", NOT_INSTALLED), NotMeasured("llamacpp", "F32", NOT_INSTALLED)]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("engine_name, module", [("llamacpp", "llama_cpp"), ("ortgenai", "onnxruntime_genai")])
def test_a_package_whose_dependency_is_missing_is_not_called_not_installed(monkeypatch, engine_name, module):
    """llama-cpp-python installed with --target (or --no-deps) without diskcache: the import fails on
    the dependency, and the row names it instead of asking for the package that is there."""
    import quantnorm.engines.llamacpp as llamacpp
    import quantnorm.engines.ortgenai as ortgenai

    def fails():
        raise ModuleNotFoundError("No module named 'diskcache'", name="diskcache")
    monkeypatch.setattr(llamacpp, "_import", fails)
    monkeypatch.setattr(ortgenai, "_genai", fails)
    why = get_engine(engine_name).available()
    assert why.startswith(f"{module} is installed but does not import (its dependency diskcache is missing): pip ")
    monkeypatch.setitem(sys.modules, module, None)   # the package itself absent: "not installed"
    monkeypatch.setattr(llamacpp, "_import", lambda: __import__("llama_cpp"))
    monkeypatch.setattr(ortgenai, "_genai", lambda: __import__("onnxruntime_genai"))
    assert get_engine(engine_name).available().startswith("not installed: pip install")


@pytest.mark.parametrize("flags,needle", [
    (["--engines", "llamacpp", "--llamacpp-types", "Q8_0,Q9_9"], "unknown llama.cpp type 'Q9_9'"),
    (["--engines", "vllm"], "unknown engine 'vllm'"),
])
def test_a_bad_engine_flag_exits_2_with_one_line(tiny_gguf, tmp_path, capsys, flags, needle):
    assert main(["evaluate", "--model", str(tiny_gguf), "--out", str(tmp_path / "run"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_impossible_engine_row_is_refused(engine_run):
    results = json.loads(json.dumps(engine_run[1]))
    results["engines"]["engines"][0]["rows"][1]["accuracy"]["kld_mean"] = -1.0
    with pytest.raises(ResultsError, match=r"engines row 1 \(llamacpp Q8_0\)\.accuracy\.kld_mean"):
        validate(results)
    results["engines"]["engines"][0]["rows"][1]["status"] = "fine"
    with pytest.raises(ResultsError, match="must be 'ok'"):
        validate(results)


def test_unknown_types_are_config_errors():
    from quantnorm.config import EvaluateConfig

    with pytest.raises(ConfigError, match="choose from F32, F16"):
        EvaluateConfig(engines=("llamacpp",), llamacpp_types=("Q3",))
    assert EvaluateConfig(llamacpp_types=("q4_k_m",)).llamacpp_types == ("Q4_K_M",)


def _vs_llamacpp():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "vs_llamacpp", Path(__file__).resolve().parents[1] / "benchmarks" / "vs_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_against_llamacpp_reads_a_run_and_runs_one(engine_run, tiny_gguf, tmp_path, capsys):
    """benchmarks/vs_llamacpp.py: the table of an existing run (its ratios are the rows' own numbers and
    its exit status the goal's), then a run of its own on the tiny GGUF with Q8_0 and Q4_K_M added."""
    from quantnorm.report.engines import engine_rows as table_rows
    from quantnorm.report.engines import quantnorm_rows, versus_llamacpp

    bench = _vs_llamacpp()
    run, results = engine_run
    code = bench.main(["--read", str(run)])
    out = capsys.readouterr().out
    versus = versus_llamacpp(quantnorm_rows(results) + table_rows(results))
    assert code == (2 if versus is None else 0 if versus.ours and versus.gen_met and versus.prompt_met else 1)
    q8 = _rows(results)["Q8_0"]["speed"]
    dynamic = next(m for m in generation_models(results) if m.name == "dynamic").decode[0]
    line = next(x for x in out.splitlines() if x.startswith("quantnorm  dynamic")).split()
    assert line[-3] == f"{dynamic['gen_tokens_per_s'] / q8['gen_tok_s']:.2f}"
    # what a step reads and the rate it streams it at: the graph's step profile, llama.cpp's file
    step = dynamic["step_profile"]["weight_bytes"]
    assert line[-2:] == [f"{step / 1e6:,.0f}", f"{step * dynamic['gen_tokens_per_s'] / 1e9:.1f}"]
    q8_line = next(x for x in out.splitlines() if x.startswith("llamacpp   Q8_0")).split()
    size = _rows(results)["Q8_0"]["size_bytes"]
    assert q8_line[-2:] == [f"{size / 1e6:,.0f}", f"{size * q8['gen_tok_s'] / 1e9:.1f}"] and "step MB" in out
    assert "threads: 1" in out and "llamacpp   Q4_0" in out

    # --retime: every row timed again here, interleaved; the ratios are of the new figures
    assert bench.main(["--read", str(run), "--retime", "1"]) in (0, 1, 2)
    out = capsys.readouterr().out
    assert "speeds: best of 1 interleaved rounds" in out
    cells = {" ".join(x.split()[:2]): x.split() for x in out.splitlines() if x.startswith(("quantnorm ", "llamacpp "))}
    q8_gen = float(cells["llamacpp Q8_0"][-4])
    dynamic = cells["quantnorm dynamic"]
    assert abs(float(dynamic[-3]) - float(dynamic[-4]) / q8_gen) <= 0.006
    assert float(dynamic[-4]) != pytest.approx(next(m for m in generation_models(results)
                                                    if m.name == "dynamic").decode[0]["gen_tokens_per_s"], abs=1e-9)

    out_dir = tmp_path / "bench"
    code = bench.main(["--", "--model", str(tiny_gguf), *SMALL, "--gen-tokens", "8,6", "--gen-batches", "1",
                       "--agreement", "4,6", "--out", str(out_dir)])
    assert code in (0, 1), capsys.readouterr()
    mine = json.loads((out_dir / "results.json").read_text())
    assert sorted(_rows(mine)) == ["Q4_K_M", "Q8_0"] and "goal, `dynamic`" in capsys.readouterr().out \
        or versus_llamacpp(quantnorm_rows(mine) + table_rows(mine)).ours is None


def test_a_benchmark_stopped_mid_run_stops_its_evaluate(tmp_path):
    """SIGTERM to benchmarks/vs_llamacpp.py while its child runs: the child goes too (a real signal
    to a real process; the child a sleeper that writes its pid)."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', "
              f"{str(Path(__file__).resolve().parents[1] / 'benchmarks' / 'vs_llamacpp.py')!r}); "
              f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
              f"sys.exit(m.run_child([sys.executable, '-c', {sleeper!r}]))")
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)   # still there (or a zombie not yet reaped by init)?
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").is_file() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the benchmark's child {child} outlived it")
    assert _vs_llamacpp().run_child([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_the_benchmark_against_llamacpp_refuses_bad_input(tmp_path, capsys):
    bench = _vs_llamacpp()
    assert bench.main(["--model", "x.gguf"]) == 2
    assert bench.main(["--read", str(tmp_path)]) == 2
    assert bench.main(["--read", str(tmp_path), "--", "--out", "x"]) == 2
    assert bench.main(["--retime", "-1", "--read", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def test_a_crash_of_the_extra_buffer_probe_keeps_them_off_and_says_why(monkeypatch, tmp_path):
    # the probe's own child process, made to crash as llama.cpp's AMX kernels do when GCC 12 built them
    from quantnorm.engines import llamacpp
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    on, why = llamacpp.extra_buffers_work(gguf)
    assert not on and why.startswith("llama.cpp crashed (SIGSEGV)") and "clang" not in why
    on, why = llamacpp.extra_buffers_work(gguf, amx=True)
    assert not on and why.endswith(llamacpp.AMX_HINT)
    monkeypatch.setattr(llamacpp, "_PROBE", "import sys; sys.exit(0)")
    assert llamacpp.extra_buffers_work(gguf, amx=True) == (True, None)
