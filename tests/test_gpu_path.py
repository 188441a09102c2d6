"""GPU numbers through the one pipeline, on a machine without a GPU: the FP16 variant, TensorRT's
precision flags, a session that fell back to the CPU is never a GPU number, a pretend GPU takes the
measured path, and benchmarks/gpu.sh runs `quantnorm evaluate` with every GPU row "not measured"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from quantnorm.export import export_onnx
from quantnorm.measure import latency, sessions
from quantnorm.measure.fp16_check import graph_fp16_range
from quantnorm.measure.latency import bench_batches
from quantnorm.measure.sessions import CPU, CUDA, TENSORRT, SessionSpec, tensorrt_options
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.quantize import get_recipe, quantize

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "benchmarks" / "gpu.sh"
CONTEXT = 16
RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 257, size=(4, CONTEXT))
PROBE = RNG.integers(0, 257, size=(2, CONTEXT))
TIMING_KEYS = {"p50_ms", "p90_ms", "p99_ms", "mean_ms", "tokens_per_s", "iterations", "node_providers", "load_s"}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """A tiny pre/rms model: FP32, its FP16 variant and a TensorRT-style INT8 QDQ copy."""
    root = tmp_path_factory.mktemp("gpu-path")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=32, n_heads=2, context=CONTEXT))
    fp32 = root / "model.fp32.onnx"
    export_onnx(model, fp32, PROBE)
    out = {"fp32": fp32}
    for name in ("fp16", "static-minmax-matmul-symact"):
        result = quantize(fp32, get_recipe(name), CALIB, root / f"model.int8.{name}.onnx", vnni=True,
                          probe_inputs=PROBE)
        assert result.status == "ok", result.problems
        out[name] = result.path
        out[name + ".settings"] = result.settings
    return out


def test_fp16_variant_is_a_recipe_of_the_pipeline(variants):
    half = onnx.load(str(variants["fp16"]))
    # weights are float16, the graph's token ids in and logits out keep their types
    assert {i.data_type for i in half.graph.initializer if i.data_type in (1, 10)} == {TensorProto.FLOAT16}
    assert half.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    ref = ort.InferenceSession(str(variants["fp32"]), providers=[CPU]).run(None, {"input_ids": PROBE})[0]
    got = ort.InferenceSession(str(variants["fp16"]), providers=[CPU]).run(None, {"input_ids": PROBE})[0]
    assert got.dtype == np.float32 and 0 < np.abs(got - ref).max() < 1e-2  # rounded, not copied
    settings = variants["fp16.settings"]
    assert settings["format"] == "FP16" and settings["fp16_range"]["status"] == "measured"
    assert settings["fp16_range"]["n_over"] == 0 and settings["fp16_range"]["tensors"] > 10
    assert "fp16" not in __import__("quantnorm.search", fromlist=["x"]).default_space()  # not an INT8 trial


def test_fp16_range_names_the_tensors_past_65504(tmp_path):
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
    found = graph_fp16_range(path, np.array([[1, 2, 3, 200]]))
    assert found["status"] == "measured" and found["n_over"] == 1
    assert found["over"] == [{"tensor": "scaled", "max_abs": 200000.0}]
    assert graph_fp16_range(path, np.array([[1, 2, 3, 4]]))["n_over"] == 0


def test_tensorrt_precision_follows_the_model(variants):
    assert tensorrt_options(variants["fp32"]) == {}
    assert tensorrt_options(variants["fp16"]) == {"trt_fp16_enable": "True"}
    assert tensorrt_options(variants["static-minmax-matmul-symact"]) == {"trt_int8_enable": "True"}


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


def test_a_fallback_to_the_cpu_is_never_a_gpu_number(variants, monkeypatch):
    monkeypatch.setattr(sessions, "provider_status", lambda provider: None)
    monkeypatch.setattr(latency, "provider_status", lambda provider: None)
    monkeypatch.setattr(sessions.ort, "InferenceSession", _FellBackToCpu)
    for provider in (CUDA, TENSORRT):
        rows = bench_batches(variants["fp16"], variant="fp16", spec=SessionSpec(provider=provider), batches=[1, 2],
                             seq=CONTEXT, warmup=1, iters=2)
        assert len(rows) == 2
        for row in rows:
            assert not row.measured and "CPUExecutionProvider" in row.status
            assert not TIMING_KEYS & set(row.to_dict())


def test_a_pretend_gpu_takes_the_measured_path(variants, monkeypatch):
    """The measured GPU path run on the CPU by a fake that claims to be the provider asked for; it
    records the provider options and the session options it was given. Only this test pretends."""
    seen: list = []
    real = ort.InferenceSession

    class Pretend:
        def __init__(self, path, sess_options=None, providers=None, **kwargs):
            first = providers[0]
            self._name = first[0] if isinstance(first, tuple) else first
            seen.append((first, sess_options.graph_optimization_level))
            self._session = real(path, sess_options, providers=[CPU])

        def get_providers(self):
            return [self._name, CPU]

        def __getattr__(self, name):
            return getattr(self._session, name)

    monkeypatch.setattr(sessions, "provider_status", lambda provider: None)
    monkeypatch.setattr(latency, "provider_status", lambda provider: None)
    monkeypatch.setattr(sessions.ort, "InferenceSession", Pretend)
    int8 = variants["static-minmax-matmul-symact"]
    cuda = bench_batches(int8, variant="int8", spec=SessionSpec(provider=CUDA), batches=[1, 2], seq=CONTEXT,
                         warmup=1, iters=2, record_placement=False)
    assert all(r.measured and r.simulated_int8 for r in cuda) and cuda[0].load_s > 0 and cuda[1].load_s is None
    trt = bench_batches(variants["fp16"], variant="fp16", spec=SessionSpec(provider=TENSORRT), batches=[1],
                        seq=CONTEXT, warmup=1, iters=2, record_placement=False)
    assert trt[0].measured and not trt[0].simulated_int8 and "graph optimizations off" in trt[0].note
    assert seen[-1] == ((TENSORRT, {"trt_fp16_enable": "True"}), ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert seen[0][1] != ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # CUDA keeps the spec's level


def test_gpu_sh_parses():
    assert subprocess.run(["bash", "-n", str(GPU_SH)], check=False).returncode == 0


def _dummy_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (qn-dummy 1.0) with an incompressible payload, a few KB."""
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


def _gpu_sh_env(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHON": sys.executable, "GPU_SITE": str(tmp_path / "site"), "GPU_SPLIT_OVER": "1000",
            "GPU_PART_SIZE": "1500", "ORT_GPU_SPEC": "qn-dummy==1.0", "TRT_SPEC": "qn-dummy"}


def test_gpu_sh_offline_install_joins_split_wheels(tmp_path):
    """--split cuts a wheel into parts with a checksum, --wheels joins and installs them offline
    into the target folder; a damaged part is refused by name, and the run goes on either way."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whl = _dummy_wheel(wheels)
    env = _gpu_sh_env(tmp_path)
    subprocess.run(["bash", str(GPU_SH), "--split", str(wheels)], env=env, check=True)
    parts = sorted(p.name for p in wheels.glob("*.part-*"))
    assert not whl.exists() and len(parts) >= 2 and (wheels / f"{whl.name}.sha256").is_file()

    # an unknown recipe makes `quantnorm evaluate` stop at once with a one-line error (exit 2): install only
    run = subprocess.run(["bash", str(GPU_SH), "--wheels", str(wheels), "--recipes", "no-such-recipe"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "unknown recipe 'no-such-recipe'" in run.stderr, run.stderr
    assert whl.is_file() and "could not install" not in run.stderr
    assert (tmp_path / "site" / "qn_dummy" / "__init__.py").is_file()  # installed into the target folder only

    whl.unlink()
    damaged = wheels / parts[0]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    run = subprocess.run(["bash", str(GPU_SH), "--wheels", str(wheels), "--recipes", "no-such-recipe"], env=env,
                         capture_output=True, text=True)
    assert "does not match its checksum" in run.stderr and not whl.exists()
    assert run.returncode == 2  # the evaluate still ran (and stopped on its own config error)


def test_gpu_sh_on_a_cpu_machine_measures_the_cpu_and_says_why_not_the_gpu(tmp_path, small_corpus):
    """The one command of a GPU slot, here: the one pipeline end to end (a tiny model on a 40 kB
    corpus: what is checked is which rows are measured, not how well), CPU rows measured, every CUDA
    and TensorRT row "not measured: why", exit 0."""
    out = tmp_path / "gpu"
    run = subprocess.run(["bash", str(GPU_SH), "--no-install", "--steps", "5", "--layers", "1", "--d-model", "32",
                          "--heads", "2", "--context", "16", "--batches", "1,2", "--iters", "2", "--calib-samples",
                          "4", "--no-outliers", "--no-generation", "--corpus", str(small_corpus), "--quiet",
                          "--out", str(out)],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert {r["name"]: r["status"] for r in results["recipes"]} == {
        "fp16": "ok", "static-minmax-matmul-symact": "ok", "dynamic": "ok"}
    fp16 = next(r for r in results["recipes"] if r["name"] == "fp16")
    assert fp16["settings"]["format"] == "FP16" and fp16["accuracy"]["ppl_ratio"] == pytest.approx(1.0, abs=0.01)
    rows = results["latency"]
    assert {r["provider"] for r in rows} == {CPU, CUDA, TENSORRT}
    assert all(r["status"] == "measured" for r in rows if r["provider"] == CPU)
    gpu = [r for r in rows if r["provider"] != CPU]
    assert len(gpu) == 2 * 4 * 2 and all(r["status"].startswith("not measured: ") for r in gpu)
    assert not any(TIMING_KEYS & set(r) for r in gpu)
    assert "not measured" in (out / "report.md").read_text()
