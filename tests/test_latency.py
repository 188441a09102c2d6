"""measure/sessions.py and measure/latency.py: honest providers, bad files, benchmark rows.

No timing thresholds: the machine is shared and noisy; only the shape of the numbers is checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantnorm.errors import ConfigError, MeasureError
from quantnorm.measure import latency, sessions
from quantnorm.measure.latency import LatencyRow, bench_grid, bench_model, node_placement, quant_format
from quantnorm.measure.sessions import (
    PROVIDERS,
    ProviderUnavailable,
    SessionSpec,
    make_session,
    provider_status,
    resolve_providers,
)

CTX = 16
TIMING_KEYS = {"p50_ms", "p90_ms", "p99_ms", "mean_ms", "tokens_per_s", "iterations", "peak_rss_mb",
               "node_providers", "node_ops", "op_ms"}
CUDA_WORKS = provider_status("cuda") is None


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A 1-layer CausalLM exported to ONNX, plus a dynamic (MatMulInteger) and a static QDQ INT8 copy."""
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static

    from quantnorm.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(n_layers=1, d_model=32, n_heads=2, context=CTX)).eval()
    d = tmp_path_factory.mktemp("lat")
    paths = {"fp32": d / "model.fp32.onnx", "dynamic": d / "model.int8.dynamic.onnx", "qdq": d / "model.int8.qdq.onnx"}
    torch.onnx.export(model, (torch.randint(0, 256, (2, 8)),), str(paths["fp32"]), dynamo=True, external_data=False,
                      opset_version=18, input_names=["input_ids"], output_names=["logits"],
                      dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=CTX)}})
    quantize_dynamic(str(paths["fp32"]), str(paths["dynamic"]), op_types_to_quantize=["MatMul"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter([{"input_ids": rng.integers(0, 256, (2, CTX), dtype=np.int64)} for _ in range(2)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(paths["fp32"]), str(paths["qdq"]), Reader(), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul"])
    return paths


# --- sessions -------------------------------------------------------------------------------

def test_session_spec_normalizes_and_validates():
    spec = SessionSpec(provider="cpu", graph_optimization_level="disable", threads=2)
    assert spec.provider == "CPUExecutionProvider"
    assert spec.graph_optimization_level == "ORT_DISABLE_ALL"
    assert spec.to_dict() == {"provider": "CPUExecutionProvider", "graph_optimization_level": "ORT_DISABLE_ALL",
                              "threads": 2}
    assert SessionSpec() == SessionSpec(provider="CPUExecutionProvider", graph_optimization_level="all")
    assert SessionSpec("tensorrt").providers == ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                 "CPUExecutionProvider"]
    assert SessionSpec("cuda").providers[-1] == "CPUExecutionProvider"
    with pytest.raises(ConfigError, match="optimization level"):
        SessionSpec(graph_optimization_level="turbo")
    with pytest.raises(ConfigError, match="threads"):
        SessionSpec(threads=0)


def test_resolve_providers():
    assert resolve_providers(["cpu", "cuda", "CPUExecutionProvider"]) == ["CPUExecutionProvider",
                                                                          "CUDAExecutionProvider"]
    usable = resolve_providers(None)
    assert "CPUExecutionProvider" in usable
    assert all(provider_status(p) is None for p in usable)
    with pytest.raises(ConfigError) as err:
        resolve_providers(["rocm"])
    for short in PROVIDERS:  # the message lists the choices
        assert short in str(err.value)


def test_provider_status_says_why(monkeypatch):
    """Each way a GPU provider can be unusable gives its own reason; a usable one gives None. The
    machine's own answer is not trusted to cover the branches: each is set up here."""
    import quantnorm.hardware

    probed: list[str] = []

    def setup(built: list[str], gpu: bool, probe: str | None = None) -> None:
        probed.clear()
        monkeypatch.setattr(sessions, "_STATUS_CACHE", {})
        monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: built)
        monkeypatch.setattr(quantnorm.hardware, "gpu_device_present", lambda: gpu)
        if hasattr(sessions, "gpu_device_present"):  # imported by name into sessions
            monkeypatch.setattr(sessions, "gpu_device_present", lambda: gpu)
        monkeypatch.setattr(sessions, "_probe", lambda p: probed.append(p) or probe)

    cpu_only = ["CPUExecutionProvider"]
    gpu_build = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    setup(cpu_only, gpu=True)
    assert provider_status("cpu") is None
    for p in ("cuda", "tensorrt"):
        assert provider_status(p).startswith("not built into this onnxruntime")
        assert "available: CPUExecutionProvider" in provider_status(p)
    setup(gpu_build, gpu=False)  # onnxruntime-gpu lists CUDA without a GPU (pitfall 3)
    assert provider_status("cuda") == "no CUDA device" and provider_status("tensorrt") == "no CUDA device"
    assert probed == []  # no session is even tried without a device
    setup(gpu_build, gpu=True, probe="libcudnn.so.9: cannot open shared object file")
    assert provider_status("cuda") == "libcudnn.so.9: cannot open shared object file"
    setup(gpu_build, gpu=True, probe=None)
    assert provider_status("cuda") is None and provider_status("tensorrt") is None
    assert probed == ["CUDAExecutionProvider", "TensorrtExecutionProvider"]
    provider_status("cuda")
    assert len(probed) == 2  # cached per process


def test_usable_providers_on_this_machine():
    assert provider_status("cpu") is None
    if CUDA_WORKS:
        assert "CUDAExecutionProvider" in resolve_providers(None)
    else:
        assert isinstance(provider_status("cuda"), str) and provider_status("cuda")
        assert "CUDAExecutionProvider" not in resolve_providers(None)


def test_make_session_runs_on_cpu(models):
    s = make_session(models["fp32"], SessionSpec(threads=1))
    assert s.get_providers() == ["CPUExecutionProvider"]
    logits = s.run(None, {"input_ids": np.zeros((1, 4), dtype=np.int64)})[0]
    assert logits.shape == (1, 4, 257)


@pytest.mark.skipif(CUDA_WORKS, reason="CUDA really works here")
def test_unavailable_provider_raises(models):
    with pytest.raises(ProviderUnavailable, match="CUDA"):
        make_session(models["fp32"], SessionSpec("cuda"))


@pytest.mark.skipif(CUDA_WORKS, reason="CUDA really works here")
def test_silent_fallback_is_caught(models, monkeypatch):
    """Pitfall 3: with the up-front check bypassed, ORT falls back to CPU; get_providers() catches it."""
    monkeypatch.setattr(sessions, "provider_status", lambda p: None)
    with pytest.raises(ProviderUnavailable, match="CUDAExecutionProvider"):
        make_session(models["fp32"], SessionSpec("cuda"))
    monkeypatch.setattr(latency, "provider_status", lambda p: None)
    row = bench_model(models["fp32"], variant="fp32", spec=SessionSpec("cuda"), batch=1, seq=4, warmup=0, iters=1)
    assert not row.measured and row.p50_ms is None  # never a CPU timing under the CUDA name


def _truncated(models, tmp_path) -> Path:
    data = models["fp32"].read_bytes()
    bad = tmp_path / "half.onnx"
    bad.write_bytes(data[: len(data) // 2])
    return bad


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "missing"])
def test_bad_model_file_is_a_one_line_measure_error(models, tmp_path, kind):
    if kind == "truncated":
        path = _truncated(models, tmp_path)
    else:
        path = tmp_path / f"{kind}.onnx"
        if kind == "garbage":
            path.write_bytes(b"\x00not an onnx model\xff" * 64)
        elif kind == "empty":
            path.write_bytes(b"")
    with pytest.raises(MeasureError) as err:
        make_session(path, SessionSpec())
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    with pytest.raises(MeasureError):
        bench_model(path, variant="fp32", spec=SessionSpec(), batch=1, seq=4, warmup=0, iters=1)


# --- latency --------------------------------------------------------------------------------

def test_measured_cpu_row(models):
    row = bench_model(models["fp32"], variant="fp32", spec=SessionSpec(threads=1), batch=2, seq=8, warmup=2, iters=12)
    assert row.measured and row.status == "measured"
    assert 0 < row.p50_ms <= row.p90_ms <= row.p99_ms
    assert row.tokens_per_s > 0 and row.mean_ms > 0
    assert row.tokens_per_s == pytest.approx(2 * 8 / (row.mean_ms / 1e3))
    assert row.size_bytes == models["fp32"].stat().st_size
    assert row.iterations == 12 and row.threads == 1 and row.peak_rss_mb > 0
    assert row.node_providers and set(row.node_providers) == {"CPUExecutionProvider"}
    assert row.simulated_int8 is False
    d = row.to_dict()
    assert d["provider"] == "CPUExecutionProvider" and d["status"] == "measured"
    assert TIMING_KEYS <= set(d)


def test_time_budget_stops_a_cell_early_and_says_so(models, tmp_path, monkeypatch):
    """max_seconds: at least MIN_TIMED_RUNS timed runs, then stop; the row counts the runs it
    timed, the note says why, the node placement (one profiled warm-up run) is still recorded and
    no profile file is left behind."""
    monkeypatch.chdir(tmp_path)
    spec = SessionSpec(threads=1)
    row = bench_model(models["qdq"], variant="qdq", spec=spec, batch=2, seq=8, warmup=4, iters=40, max_seconds=1e-9)
    assert row.measured and row.iterations == latency.MIN_TIMED_RUNS
    assert "5 of 40 timed runs" in row.note and "time budget" in row.note
    assert f"{latency.MIN_WARMUP_RUNS} of 4 warm-up runs" in row.note
    assert row.node_providers and set(row.node_providers) == {"CPUExecutionProvider"}
    assert list(tmp_path.iterdir()) == []
    roomy = bench_model(models["qdq"], variant="qdq", spec=spec, batch=2, seq=8, warmup=0, iters=7, max_seconds=3600)
    assert roomy.iterations == 7 and "time budget" not in roomy.note and roomy.node_providers
    assert "warm-up" not in bench_model(models["qdq"], variant="qdq", spec=spec, batch=2, seq=8, warmup=4, iters=5,
                                        max_seconds=3600).note
    with pytest.raises(MeasureError, match="time budget must be > 0"):
        bench_model(models["qdq"], variant="qdq", spec=spec, batch=2, seq=8, max_seconds=0)


def test_evaluate_config_checks_the_latency_budget():
    from quantnorm.config import EvaluateConfig

    assert EvaluateConfig().latency_seconds is None and EvaluateConfig(latency_seconds=20.0).latency_seconds == 20.0
    with pytest.raises(ConfigError, match="--latency-budget"):
        EvaluateConfig(latency_seconds=-1.0)


def test_quant_format_of_a_file_that_is_not_onnx(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x3a\xff\xff\xff\x0f")
    with pytest.raises(MeasureError, match="cannot read ONNX model"):
        quant_format(bad)


@pytest.mark.skipif(CUDA_WORKS, reason="CUDA really works here")
@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_gpu_request_without_gpu_is_not_measured(models, provider):
    row = bench_model(models["qdq"], variant="qdq", spec=SessionSpec(provider), batch=2, seq=8, warmup=1, iters=2)
    assert not row.measured
    assert row.status.startswith("not measured: ")
    assert row.status == "not measured: " + provider_status(provider)
    d = row.to_dict()
    assert not TIMING_KEYS & set(d)
    assert d["provider"] == PROVIDERS[provider]


def test_row_cannot_mix_status_and_timings():
    with pytest.raises(ValueError):
        LatencyRow(provider="CUDAExecutionProvider", variant="fp32", batch=1, seq=1,
                   status="not measured: no CUDA device", p50_ms=1.0)
    with pytest.raises(ValueError):
        LatencyRow(provider="CPUExecutionProvider", variant="fp32", batch=1, seq=1, status="fine")


def test_node_placement_on_cpu_is_all_cpu(models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ORT would write profiles into the working directory by default
    for variant in ("fp32", "dynamic", "qdq"):
        placement = node_placement(models[variant], SessionSpec())
        assert set(placement) == {"CPUExecutionProvider"} and placement["CPUExecutionProvider"] > 0
    unoptimized = node_placement(models["fp32"], SessionSpec(graph_optimization_level="disable"))
    assert set(unoptimized) == {"CPUExecutionProvider"}
    assert list(tmp_path.iterdir()) == []  # the profile files were deleted


def test_quant_format(models):
    assert quant_format(models["fp32"]) is None
    assert quant_format(models["dynamic"]) == "operator"
    assert quant_format(models["qdq"]) == "qdq"


def test_cuda_qdq_row_is_flagged_simulated(models, monkeypatch):
    """The flag logic alone: pretend CUDA loaded (the session really is a CPU one; test only)."""
    real_make = latency.make_session

    class Pretend:
        def __init__(self, session):
            self._s = session

        def __getattr__(self, name):
            return getattr(self._s, name)

    monkeypatch.setattr(latency, "provider_status", lambda p: None)
    monkeypatch.setattr(latency, "make_session",
                        lambda path, spec, **kw: Pretend(real_make(path, SessionSpec(threads=1), **kw)))
    spec = SessionSpec("cuda")
    qdq = bench_model(models["qdq"], variant="qdq", spec=spec, batch=1, seq=4, warmup=0, iters=2)
    assert qdq.simulated_int8 and "simulated" in qdq.note
    fp32 = bench_model(models["fp32"], variant="fp32", spec=spec, batch=1, seq=4, warmup=0, iters=2)
    assert not fp32.simulated_int8 and "simulated" not in fp32.note
    dyn = bench_model(models["dynamic"], variant="dynamic", spec=spec, batch=1, seq=4, warmup=0, iters=2,
                      record_placement=False)
    assert not dyn.simulated_int8 and dyn.node_providers is None


def test_bench_grid(models):
    rows = bench_grid({"fp32": models["fp32"], "dynamic": models["dynamic"]}, ["cpu", "cuda"], [1, 2], seq=8,
                      threads=1, warmup=1, iters=3, record_placement=False)
    assert len(rows) == 2 * 2 * 2
    assert [(r.provider, r.variant, r.batch) for r in rows[:4]] == [
        ("CPUExecutionProvider", "fp32", 1), ("CPUExecutionProvider", "fp32", 2),
        ("CPUExecutionProvider", "dynamic", 1), ("CPUExecutionProvider", "dynamic", 2)]
    assert all(r.measured for r in rows if r.provider == "CPUExecutionProvider")
    for r in rows:
        assert r.seq == 8
        if r.provider == "CUDAExecutionProvider":
            assert r.measured == CUDA_WORKS


def test_seq_beyond_context_is_a_measure_error(models):
    with pytest.raises(MeasureError, match=str(models["fp32"])):
        bench_model(models["fp32"], variant="fp32", spec=SessionSpec(), batch=1, seq=CTX + 8, warmup=0, iters=1,
                    record_placement=False)


@pytest.mark.parametrize("args, expected", [
    (["--model", "m.gguf"], 10.0),                              # a checkpoint: 10 s a cell unless told
    (["--model", "m.gguf", "--latency-budget", "5"], 5.0),
    (["--model", "m.gguf", "--latency-budget", "0"], None),     # 0: every iteration
])
def test_the_cli_default_latency_budget_applies_with_model(args, expected, monkeypatch, tmp_path):
    """Through the evaluate command itself: the configuration it hands the pipeline (the default
    once read a flag the command had already taken off, and no --model run got a budget)."""
    from quantnorm import cli, cli_flags

    seen = {}
    monkeypatch.setattr(cli, "open_model", lambda *a, **k: type("Source", (), {"run_dir": tmp_path})())
    monkeypatch.setattr(cli, "run_evaluate", lambda source, cfg, command: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr(cli, "summary_lines_model", lambda results, run_dir: "")
    assert cli.main(["evaluate", *args, "--quiet"]) == 0
    assert seen["cfg"].latency_seconds == expected and cli_flags.MODEL_LATENCY_BUDGET_S == 10.0


def test_a_zoo_evaluate_has_no_default_latency_budget():
    """Zoo runs time every iteration, as the committed sweeps (reports/reference) were grown."""
    from quantnorm.cli import evaluate, evaluate_config

    params = evaluate.make_context("evaluate", ["--placement", "pre", "--norm", "rms"]).params
    assert evaluate_config(dict(params), progress=False).latency_seconds is None


def test_batch_sizes_share_one_session_and_one_placement_profile(models, tmp_path, monkeypatch):
    """bench_grid loads each model once for all its batch sizes (a Gemma 3 FP32 load is 7 s) and
    profiles its node placement once; every batch size still gets its own row and timed runs."""
    monkeypatch.chdir(tmp_path)
    opened = []
    original = latency.make_session

    def counting(*args, **kwargs):
        opened.append(kwargs.get("profile"))
        return original(*args, **kwargs)

    monkeypatch.setattr(latency, "make_session", counting)
    rows = latency.bench_grid({"qdq": models["qdq"]}, ["CPUExecutionProvider"], [1, 2, 3], 8, threads=1,
                              warmup=1, iters=3)
    assert opened == [True]
    assert [r.batch for r in rows] == [1, 2, 3] and all(r.measured and r.iterations == 3 for r in rows)
    assert all(r.node_providers == rows[0].node_providers and r.node_providers for r in rows)
    assert list(tmp_path.iterdir()) == []


def test_kernel_time_per_op_type_comes_from_the_warm_profiled_run(models, tmp_path, monkeypatch):
    """op_ms: where the time goes inside ORT, read off the second of the two profiled runs (the
    first also pays for allocations); only the first batch's row carries it."""
    monkeypatch.chdir(tmp_path)
    rows = latency.bench_grid({"dynamic": models["dynamic"]}, ["CPUExecutionProvider"], [2, 3], 8, threads=1,
                              warmup=2, iters=3)
    first, second = rows
    ops = first.op_ms["CPUExecutionProvider"]
    assert set(first.op_ms) == {"CPUExecutionProvider"} and second.op_ms is None
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops or "MatMulIntegerToFloat" in ops
    assert all(ms >= 0 for ms in ops.values()) and list(ops.values()) == sorted(ops.values(), reverse=True)
    assert set(ops) <= set(first.node_ops["CPUExecutionProvider"])
    # one run's kernels, not the two profiled runs' sum: test_profile_facts_take_kernel_times_from_the_last_run_only
    # checks that on a profile of known times (a bound against p50 here is a wall-clock assertion: the
    # profiler's own cost per kernel is most of a 0.06 ms model's profiled run, seen 5.3x p50 in CI)
    assert "op_ms" in first.to_dict() and "op_ms" not in LatencyRow(
        provider="CPUExecutionProvider", variant="x", batch=1, seq=1, status="not measured: test").to_dict()


def test_profile_facts_take_kernel_times_from_the_last_run_only(tmp_path):
    import json

    def node(name, op, ts, dur):
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur,
                "args": {"op_name": op, "provider": "CPUExecutionProvider"}}

    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100}, node("a", "MatMul", 10, 90),
              {"cat": "Session", "name": "model_run", "ts": 200, "dur": 50}, node("a", "MatMul", 210, 30),
              node("b", "Add", 260, 4000)]   # after the run ended: not counted
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(events))
    providers, per_op, op_ms = latency._profile_facts(profile)
    assert providers == {"CPUExecutionProvider": 2} and per_op == {"CPUExecutionProvider": {"Add": 1, "MatMul": 1}}
    assert op_ms == {"CPUExecutionProvider": {"MatMul": 0.03}}


def test_bench_rounds_interleave_the_models_and_keep_each_cells_lowest_round(models, tmp_path, monkeypatch):
    """rounds=3: A, B, A, B, A, B; each cell is its fastest round, the note lists all three, and the
    placement and kernel times come from the first (the only profiled) round."""
    from dataclasses import replace

    monkeypatch.chdir(tmp_path)
    order, slow = [], iter([0.0, 0.05, 0.0, 0.0, 0.05, 0.0])   # seconds added to each cell in turn
    real = latency.bench_batches

    def traced(path, **kwargs):
        order.append((kwargs["variant"], kwargs["record_placement"]))
        rows = real(path, **kwargs)
        extra = next(slow) * 1e3
        return [replace(r, p50_ms=r.p50_ms + extra) for r in rows]

    monkeypatch.setattr(latency, "bench_batches", traced)
    paths = {"fp32": models["fp32"], "dynamic": models["dynamic"]}
    rows = latency.bench_rounds(paths, ["CPUExecutionProvider"], [2], 8, rounds=3, threads=1, warmup=1, iters=3)
    assert order == [("fp32", True), ("dynamic", True), ("fp32", False), ("dynamic", False),
                     ("fp32", False), ("dynamic", False)]
    fp32, dyn = rows
    assert "lowest p50 of 3 interleaved rounds" in fp32.note and fp32.note.count(",") >= 2
    assert fp32.p50_ms < 50 and dyn.p50_ms < 50   # the slowed rounds (+50 ms) are never the one kept
    assert fp32.node_providers and fp32.op_ms and dyn.op_ms
    with pytest.raises(MeasureError, match="at least one round"):
        latency.bench_rounds(paths, ["CPUExecutionProvider"], [2], 8, rounds=0)


def test_bench_cli_rounds(models, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from quantnorm.cli import cli
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, ["bench", str(models["dynamic"]), "--providers", "cpu", "--batches", "1",
                                      "--seq", "8", "--iters", "2", "--warmup", "1", "--threads", "1",
                                      "--rounds", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())
    assert "lowest p50 of 2 interleaved rounds" in row["note"] and row["op_ms"]
    bad = CliRunner().invoke(cli, ["bench", str(models["dynamic"]), "--rounds", "0"])
    assert bad.exit_code == 2 and "--rounds" in bad.output
