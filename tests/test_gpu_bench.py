"""quantnorm.gpu_bench and quantize.fp16 on the CPU: the no-GPU path end to end, and that a session
that fell back to the CPU never yields a GPU number. Tiny model (1 layer, d 32, 5 steps)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from quantnorm import gpu_bench
from quantnorm.gpu_bench import (
    FP16,
    FP32,
    INT8,
    NO_GPU,
    Budget,
    EngineSpec,
    GpuBenchConfig,
    measure_group,
    prepare_extra,
    prepare_zoo,
    summary_table,
    trt_options,
)
from quantnorm.measure import latency, sessions
from quantnorm.measure.sessions import CPU, CUDA, TENSORRT

TIMING_KEYS = {"p50_ms", "p90_ms", "p99_ms", "mean_ms", "tokens_per_s", "iterations", "node_providers", "node_ops"}
SIZE = dict(steps=5, layers=1, d_model=32, heads=2, context=32, batches=(1, 2), iters=2, warmup=1, cpu_iters=2,
            cpu_warmup=1, eval_windows=4, calib_samples=4, progress=False)
CLI_SIZE = ["--steps", "5", "--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batches", "1,2",
            "--iters", "2", "--warmup", "1", "--cpu-iters", "2", "--eval-windows", "4", "--quiet"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-zoo")


@pytest.fixture(scope="module")
def zoo(work):
    cfg = GpuBenchConfig(work_dir=work, out_dir=work / "out", **SIZE)
    return cfg, prepare_zoo(cfg)


@pytest.fixture
def no_gpu(monkeypatch):
    # Both readers of the device check: gpu_bench's own reasons and the provider probe's.
    monkeypatch.setattr(gpu_bench, "gpu_device_present", lambda: False)
    monkeypatch.setattr(sessions, "gpu_device_present", lambda: False)
    monkeypatch.setattr(sessions, "_STATUS_CACHE", {})


def test_variants_are_fp32_fp16_and_int8(zoo):
    _, group = zoo
    assert [v.name for v in group.variants] == [FP32, FP16, INT8]
    assert all(v.status == "ok" and v.path.is_file() for v in group.variants)
    half = onnx.load(str(group.variant(FP16).path))
    # Weights are float16, the graph's input (token ids) and output (logits) keep their types.
    assert {i.data_type for i in half.graph.initializer if i.data_type in (1, 10)} == {onnx.TensorProto.FLOAT16}
    assert half.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ids = group.inputs[:2]
    ref = ort.InferenceSession(str(group.variant(FP32).path), providers=[CPU]).run(None, {"input_ids": ids})[0]
    out = ort.InferenceSession(str(group.variant(FP16).path), providers=[CPU]).run(None, {"input_ids": ids})[0]
    assert out.dtype == np.float32
    assert np.abs(out - ref).max() < 1e-2
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(group.variant(INT8).path)).graph.node)


def test_no_gpu_path_end_to_end(zoo, work, tmp_path, no_gpu):
    out = tmp_path / "gpu"
    result = CliRunner().invoke(gpu_bench._cli(), ["--out", str(out), "--work-dir", str(work), *CLI_SIZE])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    gpu_lines = [line for line in lines if " CUDA " in line or " TensorRT " in line]
    assert len(gpu_lines) == 6 and all(f"not measured: {NO_GPU}" in line for line in gpu_lines)

    results = json.loads((out / "results.json").read_text())
    assert results["schema_version"] == 2 and results["hardware"]["gpu"] is None
    # Five steps teach the tiny model nothing: the report says so instead of hiding it.
    assert results["model"]["train"]["status"] == "collapsed"
    for row in results["latency"]:
        if row["provider"] == CPU:
            assert row["status"] == "measured" and row["p50_ms"] > 0 and row["node_providers"] == {CPU: row["node_providers"][CPU]}
        else:
            assert row["status"] == f"not measured: {NO_GPU}" and not TIMING_KEYS & set(row)
    assert {e["name"] for e in results["references"]} == {FP32} and FP32 not in {e["name"] for e in results["recipes"]}
    cpu_acc = {e["name"]: e["accuracy"] for e in results["recipes"] if e["session"]["provider"] == CPU}
    assert cpu_acc[INT8]["status"] == "measured" and 0.5 < cpu_acc[INT8]["ppl_ratio"] < 2
    assert all(e["accuracy"]["status"] == f"not measured: {NO_GPU}"
               for e in results["recipes"] if e["session"]["provider"] != CPU)
    assert all(b["status"] == f"not measured: {NO_GPU}" for b in results["engine_builds"])
    assert "not measured: no CUDA device" in (out / "report.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]  # nothing half-written


class _FellBackToCpu:
    """What onnxruntime-gpu does when a GPU provider cannot load: a CPU session that says so only
    through get_providers()."""

    real = ort.InferenceSession

    def __init__(self, path, sess_options=None, providers=None, **kwargs):
        self._session = self.real(path, sess_options, providers=[CPU])

    def get_providers(self):
        return [CPU]

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_fallback_to_the_cpu_is_never_a_gpu_number(zoo, tmp_path, monkeypatch):
    cfg, group = zoo
    # Pretend both GPU providers are usable, and make every session quietly land on the CPU.
    monkeypatch.setattr(sessions, "provider_status", lambda provider: None)
    monkeypatch.setattr(latency, "provider_status", lambda provider: None)
    monkeypatch.setattr(sessions.ort, "InferenceSession", _FellBackToCpu)
    reasons = {CPU: None, CUDA: None, TENSORRT: None}
    accuracy, rows, builds = measure_group(group, cfg, reasons, Budget(1e9), tmp_path)

    gpu_rows = [r for r in rows if r.provider != CPU]
    assert len(gpu_rows) == 2 * 3 * len(cfg.batches)
    for row in gpu_rows:
        assert not row.measured and "CPUExecutionProvider" in row.status
        assert not TIMING_KEYS & set(row.to_dict())
    assert all(r.measured for r in rows if r.provider == CPU)
    for entry in accuracy:
        if entry["session"]["provider"] != CPU:
            assert entry["accuracy"]["status"].startswith("not measured: ") and "ppl_ratio" not in entry["accuracy"]
    assert len(builds) == 3 and all(b["status"].startswith("not measured: ") and "engine_build_s" not in b
                                    for b in builds)

    results = {"settings": {"batches": list(cfg.batches)}, "engine_builds": builds, "recipes": accuracy,
               "latency": [{"model": group.name, **r.to_dict()} for r in rows]}
    for line in summary_table(results)[2:]:
        if " CUDA " in line or " TensorRT " in line:
            assert "not measured" in line


def test_budget_spent_is_not_measured(zoo, tmp_path):
    cfg, group = zoo
    spent = Budget(1.0, start=0.0)
    _, rows, _ = measure_group(group, replace(cfg, providers=("cpu",)), {CPU: None}, spent, tmp_path)
    assert rows and all(not r.measured and "time budget" in r.status for r in rows)


def test_tensorrt_options_per_variant(tmp_path):
    opts = dict(trt_options(INT8, "input_ids", 128, 32, tmp_path))
    assert opts["trt_int8_enable"] == "True" and "trt_fp16_enable" not in opts
    assert opts["trt_profile_min_shapes"] == "input_ids:1x128" and opts["trt_profile_max_shapes"] == "input_ids:32x128"
    assert dict(trt_options(FP16, "x", 8, 4, tmp_path))["trt_fp16_enable"] == "True"
    assert not {"trt_int8_enable", "trt_fp16_enable"} & set(dict(trt_options(FP32, "x", 8, 4, tmp_path)))
    spec = EngineSpec(provider="tensorrt", options=trt_options(INT8, "input_ids", 128, 32, tmp_path))
    assert spec.providers[0] == (TENSORRT, opts) and spec.providers[1:] == [CUDA, CPU]
    assert "trt_engine_cache_path" not in spec.to_dict()["provider_options"]


def test_extra_onnx_models_on_random_tokens(zoo, tmp_path):
    cfg, group = zoo
    extra = GpuBenchConfig(work_dir=tmp_path, out_dir=tmp_path / "out", zoo=False, providers=("cpu",),
                           extra_onnx=(group.variant(INT8).path,), **SIZE)
    (g,) = prepare_extra(extra)
    # The INT8 file's reference is the FP32 model beside it; an FP16 copy is made in the work dir.
    assert [v.name for v in g.variants] == [FP32, FP16, f"{INT8}:{group.variant(INT8).path.name}"]
    assert g.targets is None and "random" in g.windows
    accuracy, rows, _ = measure_group(g, extra, {CPU: None}, Budget(1e9), tmp_path)
    acc = accuracy[-1]["accuracy"]
    assert acc["status"] == "measured" and 0 <= acc["top1_agreement"] <= 1 and "ppl_ratio" not in acc
    assert all(r.measured for r in rows)

    # With --windows (a .npy: next tokens are the targets) the perplexity ratio is measured too.
    np.save(tmp_path / "windows.npy", group.inputs)
    (g,) = prepare_extra(replace(extra, windows=tmp_path / "windows.npy"))
    assert g.seq == group.inputs.shape[1] - 1
    accuracy, _, _ = measure_group(g, replace(extra, batches=(1,)), {CPU: None}, Budget(1e9), tmp_path)
    acc = accuracy[-1]["accuracy"]
    assert acc["status"] == "measured" and 0.5 < acc["ppl_ratio"] < 2

    # A .npz carries the source's own protocol windows: on the zoo's they give compare's numbers.
    np.savez(tmp_path / "windows.npz", inputs=group.inputs, targets=group.targets)
    (g,) = prepare_extra(replace(extra, windows=tmp_path / "windows.npz"))
    assert g.seq == group.inputs.shape[1] and (g.targets == group.targets).all()
    accuracy, _, _ = measure_group(g, replace(extra, batches=(1,)), {CPU: None}, Budget(1e9), tmp_path)
    zoo_acc, _, _ = measure_group(group, replace(cfg, providers=("cpu",), batches=(1,)), {CPU: None}, Budget(1e9),
                                  tmp_path)
    mine, theirs = accuracy[-1]["accuracy"], next(e for e in zoo_acc if e["name"] == INT8)["accuracy"]
    for key in ("ppl_fp32", "ppl_int8", "ppl_ratio", "kld_mean", "top1_agreement"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-6), key


def test_config_errors_are_one_line(tmp_path, no_gpu):
    result = CliRunner().invoke(gpu_bench._cli(), ["--out", str(tmp_path), "--providers", "cuda"])
    assert result.exit_code == 2 and "CPU provider is the reference" in result.output


def test_gpu_sh_parses():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def _dummy_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (qn-dummy 1.0) with an incompressible payload, a few KB."""
    import os
    import zipfile

    whl = folder / "qn_dummy-1.0-py3-none-any.whl"
    files = {"qn_dummy/__init__.py": "VALUE = 42\n", "qn_dummy/payload.bin": os.urandom(3000).hex(),
             "qn_dummy-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: qn-dummy\nVersion: 1.0\n",
             "qn_dummy-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n"}
    files["qn_dummy-1.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + \
        "qn_dummy-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


def test_gpu_sh_offline_install_joins_split_wheels(tmp_path):
    """--split cuts a wheel into parts with a checksum, --wheels joins and installs them offline
    into the target folder; a damaged part is refused by name, and the run goes on either way."""
    import os
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whl = _dummy_wheel(wheels)
    env = {**os.environ, "PYTHON": sys.executable, "GPU_SITE": str(tmp_path / "site"), "GPU_SPLIT_OVER": "1000",
           "GPU_PART_SIZE": "1500", "ORT_GPU_SPEC": "qn-dummy==1.0", "TRT_SPEC": "qn-dummy"}
    subprocess.run(["bash", str(script), "--split", str(wheels)], env=env, check=True)
    parts = sorted(p.name for p in wheels.glob("*.part-*"))
    assert not whl.exists() and len(parts) >= 2 and (wheels / f"{whl.name}.sha256").is_file()

    # --providers cuda makes gpu_bench stop at once with a config error (exit 2): install only.
    run = subprocess.run(["bash", str(script), "--wheels", str(wheels), "--providers", "cuda"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "CPU provider is the reference" in run.stderr, run.stderr
    assert whl.is_file() and "could not install" not in run.stderr
    assert (tmp_path / "site" / "qn_dummy" / "__init__.py").is_file()  # installed into the target folder only

    whl.unlink()
    damaged = wheels / parts[0]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    run = subprocess.run(["bash", str(script), "--wheels", str(wheels), "--providers", "cuda"], env=env,
                         capture_output=True, text=True)
    assert "does not match its checksum" in run.stderr and not whl.exists()
    assert run.returncode == 2  # the benchmark still ran (and stopped on its own config error)


def test_gpu_code_path_with_a_pretend_gpu(zoo, tmp_path, monkeypatch):
    """The measured-GPU path (engine builds, simulated-INT8 labels, the table) run on the CPU by a
    fake that claims to be the provider asked for; it records the TensorRT options it was given.
    Only this test pretends: nothing it produces is written anywhere a report would be read."""
    cfg, group = zoo
    seen: list = []
    real = ort.InferenceSession

    class Pretend:
        def __init__(self, path, sess_options=None, providers=None, **kwargs):
            first = providers[0]
            self._name = first[0] if isinstance(first, tuple) else first
            seen.append(first)
            self._session = real(path, sess_options, providers=[CPU])

        def get_providers(self):
            return [self._name, CPU]

        def __getattr__(self, name):
            return getattr(self._session, name)

    monkeypatch.setattr(sessions, "provider_status", lambda provider: None)
    monkeypatch.setattr(latency, "provider_status", lambda provider: None)
    monkeypatch.setattr(sessions.ort, "InferenceSession", Pretend)
    accuracy, rows, builds = measure_group(group, cfg, {CPU: None, CUDA: None, TENSORRT: None}, Budget(1e9),
                                           tmp_path)
    assert all(r.measured for r in rows)
    assert {r.variant for r in rows if r.simulated_int8} == {INT8}
    assert all(r.provider == CUDA for r in rows if r.simulated_int8)
    assert [b["variant"] for b in builds] == [FP32, FP16, INT8]
    assert all(b["status"] == "measured" and b["engine_build_s"] > 0 for b in builds)
    trt = [dict(opts) for name, opts in (s for s in seen if isinstance(s, tuple))]
    assert any(o.get("trt_int8_enable") == "True" for o in trt) and any(o.get("trt_fp16_enable") == "True" for o in trt)
    assert {e["session"]["graph_optimization_level"] for e in accuracy if e["session"]["provider"] == TENSORRT} \
        == {"ORT_DISABLE_ALL"}
    assert all(e["accuracy"]["status"] == "measured" for e in accuracy)
    results = {"settings": {"batches": list(cfg.batches)}, "engine_builds": builds, "models": [{"name": "zoo"}],
               "references": [e for e in accuracy if e["name"] == FP32],
               "recipes": [e for e in accuracy if e["name"] != FP32],
               "latency": [{"model": group.name, **r.to_dict()} for r in rows]}
    table = summary_table(results)
    assert len(table) == 2 + 9 and not any("not measured" in line for line in table)
    assert sum("(simulated INT8)" in line for line in table) == 1


def test_install_failures_are_named_in_the_reason_of_their_provider(monkeypatch):
    monkeypatch.setenv(gpu_bench.INSTALL_ENV, "mode=offline;failed=tensorrt-cu13-libs>=10.13,<11|numpy>=1.26")
    monkeypatch.setattr(gpu_bench, "gpu_device_present", lambda: True)
    monkeypatch.setattr(gpu_bench, "_preload_gpu_libraries", lambda: None)
    monkeypatch.setattr(gpu_bench, "provider_status",
                        lambda p: None if p in (CPU, CUDA) else "TensorRT provider failed to load (missing library)")
    install = gpu_bench.install_section()
    assert install == {"mode": "offline", "failed": ["tensorrt-cu13-libs>=10.13,<11", "numpy>=1.26"]}
    reasons = gpu_bench.provider_reasons((CPU, CUDA, TENSORRT), install)
    assert reasons[CPU] is None and reasons[CUDA] is None
    assert reasons[TENSORRT].endswith("(gpu.sh could not install: tensorrt-cu13-libs>=10.13,<11)")


def test_fp16_range_names_the_tensors_past_65504(tmp_path):
    from onnx import TensorProto, helper

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["as_float"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["as_float", "big"], ["scaled"]),
         helper.make_node("Div", ["scaled", "big"], ["logits"])],
        "range", [ids], [out], [helper.make_tensor("big", TensorProto.FLOAT, [], [1000.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    found = gpu_bench.fp16_range(path, np.array([[1, 2, 3, 200]]))
    assert found["status"] == "measured" and found["n_over"] == 1
    assert found["over"] == [{"tensor": "scaled", "max_abs": 200000.0}]
    assert gpu_bench.fp16_range(path, np.array([[1, 2, 3, 4]]))["n_over"] == 0
