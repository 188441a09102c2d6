"""GPU numbers in one command: FP32, FP16 and INT8 on the CUDA and TensorRT providers, with the
CPU as reference; ``benchmarks/gpu.sh`` installs the GPU libraries and runs this.

    python -m quantnorm.gpu_bench [--out reports/gpu] [--onnx RUN_DIR/model.fp32.onnx ...]

What it does, all within a few minutes of one GPU (``--budget-s``; cells past the budget are
recorded as not measured, never dropped silently):

1. trains a small zoo model if the work directory has none (about a minute on 16 cores), exports
   it to FP32 ONNX, makes the FP16 copy (``quantize.fp16``: float32 in and out) and the INT8 QDQ
   copy (a registry recipe; signed symmetric activations by default, the form TensorRT builds
   real INT8 engines from);
2. for every model x provider x variant: accuracy against the FP32 model *on the same provider*
   (PPL ratio, KL, top-1 on the evaluation windows), latency p50/p90/p99 per batch size, which
   provider ran each node (ORT's profile), and for TensorRT the engine build time apart from the
   run time (the FP16/INT8 engine flags are the variant's: ``trt_fp16_enable`` / ``trt_int8_enable``);
3. writes ``results.json`` (the RESULTS.md contract, plus ``gpu``, ``install``, ``models`` and
   ``engine_builds``; every ``recipes`` and ``latency`` entry names its ``model``, and
   ``accuracy.ppl_int8`` keeps the contract's name for the perplexity of the variant under test,
   FP16 included) and ``report.md`` atomically, and prints a one-screen table.

Honesty rules (PITFALLS.md 3 and 4): a provider is measured only when ``make_session`` confirms
the session really runs on it; without a GPU every CUDA/TensorRT row reads "not measured: no CUDA
device" and the command still exits 0; a QDQ model on CUDA is labelled simulated INT8.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.capi import build_and_package_info as ort_build

from .calibration import calibration_windows
from .data import DataConfig, evaluation_windows, prepare_data
from .errors import ConfigError, MeasureError, QuantnormError
from .evaluate import ensure_trained
from .export import export_onnx
from .fileio import write_json_atomic, write_text_atomic
from .hardware import cpu_has_vnni, gpu_device_present
from .measure.accuracy import compare, log_softmax, run_logits
from .measure.latency import NOT_MEASURED, LatencyRow, bench_model, not_measured, quant_format, random_input_ids
from .measure.sessions import (
    CPU,
    CUDA,
    PROVIDERS,
    TENSORRT,
    ProviderUnavailable,
    SessionSpec,
    make_session,
    provider_status,
)
from .models import ModelConfig
from .quantize import get_recipe, quantize
from .quantize.fp16 import FP16_MAX, convert_fp16
from .results import header as results_header
from .runs import TRAIN_SUMMARY_FILE
from .train import RunConfig, TrainConfig, default_warmup, load_model

GPU_PROVIDERS = (CUDA, TENSORRT)
NO_GPU = "no CUDA device"
FP32, FP16, INT8 = "fp32", "fp16", "int8"
RESULTS_NAME, REPORT_NAME = "results.json", "report.md"
INSTALL_ENV = "QUANTNORM_GPU_INSTALL"

# Distributions whose versions decide the GPU numbers (recorded when installed).
LIBRARY_DISTS = ("onnxruntime-gpu", "onnxruntime", "torch", "onnx", "tensorrt", "tensorrt-cu13", "tensorrt-cu13-libs",
                 "tensorrt-cu13-bindings", "tensorrt-cu12", "tensorrt-cu12-libs", "nvidia-cudnn-cu13",
                 "nvidia-cudnn-cu12", "nvidia-cublas", "nvidia-cublas-cu12", "nvidia-cuda-runtime",
                 "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvrtc", "nvidia-curand", "nvidia-curand-cu12", "nvidia-cufft")


@dataclass(frozen=True)
class GpuBenchConfig:
    """Everything the GPU run decides; sizes are chosen so the whole run fits 6 minutes."""

    out_dir: Path = Path("reports/gpu")
    work_dir: Path = Path("runs/gpu-zoo")   # the zoo model's run directory and its ONNX variants
    placement: str = "pre"
    norm: str = "rms"
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    context: int = 128
    steps: int = 150
    train_batch: int = 32
    batches: tuple[int, ...] = (1, 8, 32)
    iters: int = 50
    warmup: int = 10
    cpu_iters: int = 20                      # the CPU reference is slow at batch 32 and not what the lease is for
    cpu_warmup: int = 3
    eval_windows: int = 64
    calib_samples: int = 32
    int8_recipe: str = "static-minmax-matmul-symact"
    providers: tuple[str, ...] = ("cpu", "cuda", "tensorrt")
    extra_onnx: tuple[Path, ...] = ()
    windows: Path | None = None              # token windows (.npz inputs/targets or .npy) for the extra models
    budget_s: float = 330.0                  # soft limit on the whole run: cells past it are "not measured"
    progress: bool = True
    zoo: bool = True                         # measure the zoo model (off: only --onnx models)

    def __post_init__(self) -> None:

        ModelConfig(placement=self.placement, norm=self.norm, n_layers=self.layers, d_model=self.d_model,
                    n_heads=self.heads, context=self.context)
        get_recipe(self.int8_recipe)
        object.__setattr__(self, "providers", tuple(PROVIDERS[p] if p in PROVIDERS else p for p in self.providers))
        for p in self.providers:
            if p not in PROVIDERS.values():
                raise ConfigError(f"unknown provider {p!r}: choose from {', '.join(PROVIDERS)}")
        if CPU not in self.providers:
            raise ConfigError("the CPU provider is the reference and cannot be left out")
        if not self.batches or min(self.batches) < 1:
            raise ConfigError(f"batch sizes must be >= 1, got {self.batches}")
        if min(self.iters, self.cpu_iters, self.eval_windows, self.steps) < 1 or min(self.warmup, self.cpu_warmup) < 0:
            raise ConfigError("iters, CPU iters, eval windows and steps must be >= 1, warm-ups >= 0")
        if not self.budget_s > 0:
            raise ConfigError(f"--budget-s must be > 0, got {self.budget_s}")
        for path in self.extra_onnx:
            if not Path(path).is_file():
                raise ConfigError(f"--onnx {path}: no such file")
        if self.windows is not None and not Path(self.windows).is_file():
            raise ConfigError(f"--windows {self.windows}: no such file")
        if not self.zoo and not self.extra_onnx:
            raise ConfigError("nothing to measure: --no-zoo needs at least one --onnx FILE")
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError(f"--out {self.out_dir} is an existing file: give a directory")


# --- sessions with provider options ---------------------------------------------------------

@dataclass(frozen=True)
class EngineSpec(SessionSpec):
    """A SessionSpec whose first provider gets ORT provider options (TensorRT's precision flags,
    engine cache, shape profile). ``make_session`` still checks that the session really runs on
    ``provider``, so a fallback to the CPU is refused exactly as for a plain spec."""

    options: tuple[tuple[str, str], ...] = ()

    @property
    def providers(self) -> list:
        chain = super().providers
        return [(chain[0], dict(self.options)), *chain[1:]] if self.options else chain

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.options:
            # The cache path is a temporary directory: not a setting anyone reproduces.
            out["provider_options"] = {k: v for k, v in self.options if k != "trt_engine_cache_path"}
        return out


def trt_options(variant: str, input_name: str, seq: int, max_batch: int, cache_dir: Path) -> tuple:
    """TensorRT options for a variant: precision flags, an engine cache (so the timed and profiled
    sessions reuse the engine built once) and one shape profile covering every batch size (so no
    engine is rebuilt when the batch changes)."""
    flags = {FP16: {"trt_fp16_enable": "True"}, INT8: {"trt_int8_enable": "True"}}.get(variant, {})
    return tuple({
        **flags,
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_profile_min_shapes": f"{input_name}:1x{seq}",
        "trt_profile_opt_shapes": f"{input_name}:{max_batch}x{seq}",
        "trt_profile_max_shapes": f"{input_name}:{max_batch}x{seq}",
    }.items())


# --- what is installed ------------------------------------------------------------------------

def install_section() -> dict:
    """What benchmarks/gpu.sh installed (it exports QUANTNORM_GPU_INSTALL="mode=...;failed=a|b")."""
    raw = os.environ.get(INSTALL_ENV)
    if not raw:
        return {"mode": "not run through benchmarks/gpu.sh", "failed": []}
    fields = dict(part.split("=", 1) for part in raw.split(";") if "=" in part)
    return {"mode": fields.get("mode", "unknown"), "failed": [f for f in fields.get("failed", "").split("|") if f]}


def _preload_gpu_libraries() -> None:
    """Let onnxruntime-gpu find CUDA and cuDNN in pip's nvidia packages before the first session
    (gpu.sh also puts them on LD_LIBRARY_PATH; this covers a plain ``python -m`` run)."""

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21
    if preload is None or CUDA not in ort.get_available_providers():
        return
    try:
        preload()
    except Exception:  # noqa: BLE001 -- a library it cannot find is reported by the provider probe
        pass


def provider_reasons(providers: tuple[str, ...], install: dict | None = None) -> dict[str, str | None]:
    """None for a usable provider, else why not. A missing GPU is said the same way whatever the
    onnxruntime build (a CPU-only build would otherwise say "not built into ..."); with a GPU, a
    failed install by gpu.sh is named beside ORT's own reason."""

    gpu = gpu_device_present()
    if gpu:
        _preload_gpu_libraries()
    failed = (install or {}).get("failed") or []
    reasons: dict[str, str | None] = {}
    for p in providers:
        if p in GPU_PROVIDERS and not gpu:
            reasons[p] = NO_GPU
            continue
        reason = provider_status(p)
        # Only the packages this provider loads: onnxruntime-gpu for both, TensorRT's for TensorRT.
        relevant = [f for f in failed if "onnxruntime" in f or (p == TENSORRT and "tensorrt" in f)]
        if reason is not None and relevant:
            reason += f" (gpu.sh could not install: {', '.join(relevant)})"
        reasons[p] = reason
    return reasons


def _smi(query: str) -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def gpu_section() -> dict:
    """GPU name, driver, memory, compute capability (nvidia-smi), and the GPU library versions."""
    rows = _smi("name,driver_version,memory.total,compute_cap")
    gpus = []
    for row in rows:
        parts = [p.strip() for p in row.split(",")]
        parts += [""] * (4 - len(parts))
        gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2], "compute_capability": parts[3]})
    libraries = {}
    for dist in LIBRARY_DISTS:
        try:
            libraries[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    section: dict = {"gpus": gpus, "libraries": libraries}
    # The CUDA version onnxruntime-gpu was built for (a CPU build has no cuda_version).
    section["onnxruntime_cuda"] = getattr(ort_build, "cuda_version", None)
    try:
        section["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            section["torch_cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 -- a broken torch must not stop the GPU report
        pass
    return section


# --- the budget -------------------------------------------------------------------------------

@dataclass
class Budget:
    """Wall-clock budget of the measuring; ``spent()`` says why a cell is skipped once it is over."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def spent(self) -> str | None:
        used = time.perf_counter() - self.start
        return f"time budget of {self.seconds:.0f} s spent (--budget-s)" if used > self.seconds else None


# --- models and variants ----------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str                   # fp32, fp16, int8
    path: Path | None
    status: str = "ok"          # ok or "broken: <why>"
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ModelGroup:
    """One model measured in its variants: the windows its accuracy is read on, and their kind."""

    name: str
    variants: tuple[Variant, ...]
    inputs: np.ndarray | None            # [n, seq] token ids
    targets: np.ndarray | None           # None: no perplexity (random tokens)
    windows: str                         # what the windows are, for the report
    seq: int
    zoo: bool = False
    section: dict = field(default_factory=dict)

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)


def prepare_zoo(cfg: GpuBenchConfig) -> ModelGroup:
    """Train (when absent), export and make the FP16 and INT8 variants of the zoo model."""

    # The CLI's defaults (lr, seed, corpus, the warm-up rule), built here: no import of the cli.
    run = RunConfig(
        model=ModelConfig(placement=cfg.placement, norm=cfg.norm, n_layers=cfg.layers, d_model=cfg.d_model,
                          n_heads=cfg.heads, context=cfg.context),
        train=TrainConfig(steps=cfg.steps, batch_size=cfg.train_batch, warmup=default_warmup(cfg.steps)),
        data=DataConfig(),
    )
    data = prepare_data(run.data, run.model.context)
    work = Path(cfg.work_dir)
    run_dir = ensure_trained(run, work, data, cfg.progress)
    model, _ = load_model(run_dir)
    eval_inputs, eval_targets = evaluation_windows(data.tokens, data.splits.evaluation, data.window)
    eval_inputs, eval_targets = eval_inputs[: cfg.eval_windows], eval_targets[: cfg.eval_windows]
    calib = calibration_windows(data.tokens, data.splits.calibration, data.window, cfg.calib_samples)

    fp32_path = work / "model.fp32.onnx"
    exported = export_onnx(model, fp32_path, eval_inputs[:4])
    variants = [Variant(FP32, fp32_path, settings={"max_abs_logit_diff": exported.max_abs_logit_diff})]
    variants.append(_fp16_variant(fp32_path, work / "model.fp16.onnx", convert_fp16, eval_inputs[:1]))
    recipe = get_recipe(cfg.int8_recipe)
    try:
        q = quantize(fp32_path, recipe, calib, work / f"model.int8.{recipe.name}.onnx", vnni=cpu_has_vnni(),
                     probe_inputs=eval_inputs[:2])
        variants.append(Variant(INT8, q.path if q.status == "ok" else None, q.status,
                                {"recipe": recipe.name, **q.settings}))
    except QuantnormError as exc:  # a failed INT8 copy is this variant's result, not the run's end
        variants.append(Variant(INT8, None, f"broken: {exc}", {"recipe": recipe.name}))
    summary = run_dir.read_json(TRAIN_SUMMARY_FILE)
    section = {"placement": cfg.placement, "norm": cfg.norm, "n_layers": cfg.layers, "d_model": cfg.d_model,
               "n_heads": cfg.heads, "context": cfg.context, "n_params": model.n_params(), "source": "trained",
               "steps": cfg.steps, "run_dir": _rel(work),
               "train": {k: summary[k] for k in ("status", "eval_bits_per_byte", "unigram_bits_per_byte", "diverged")
                         if k in summary}}
    return ModelGroup("zoo", tuple(variants), eval_inputs, eval_targets,
                      f"{len(eval_inputs)} evaluation windows of the built-in corpus (bytes)", data.window,
                      zoo=True, section=section)


def fp16_range(fp32_path: Path, window: np.ndarray, top: int = 5) -> dict:
    """Which float tensors of the FP32 model pass float16's largest value (65504) on one window.

    The CPU provider hides an FP16 overflow (PITFALLS.md 13), and on a GPU an RMSNorm whose
    square overflows gives finite but wrong numbers (x * rsqrt(inf) = 0): this names the tensors
    before any GPU runs. Every float tensor is exposed as an output of one CPU session without
    graph optimization (so each exists as written), run on ``window`` [1, seq].
    """


    model = onnx.load(str(fp32_path))
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {vi.name for vi in inferred.graph.value_info if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    existing = {o.name for o in model.graph.output}
    names = [o for node in model.graph.node for o in node.output if o in floats and o not in existing]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    names += [o.name for o in model.graph.output[: len(existing)]
              if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=[CPU])
        values = session.run(names, {session.get_inputs()[0].name: np.ascontiguousarray(window, dtype=np.int64)})
    except Exception as exc:  # noqa: BLE001 -- the check is a diagnosis; its failure is recorded, not raised
        return {"status": f"not measured: {' '.join(str(exc).split())[:200]}"}
    peaks = {n: float(np.max(np.abs(v))) if v.size else 0.0 for n, v in zip(names, values)}
    # Attention masks built from float32's lowest value (Hugging Face's causal mask) are sentinels,
    # not activations: the conversion clips that constant to -65504 and the softmax still gives 0.
    sentinel = float(np.finfo(np.float32).max) / 2
    masks = [n for n, m in peaks.items() if m >= sentinel]
    real = {n: m for n, m in peaks.items() if m < sentinel or np.isnan(m)}
    over = sorted(((n, m) for n, m in real.items() if not m <= FP16_MAX), key=lambda item: -item[1])
    largest = max(real.items(), key=lambda item: item[1]) if real else (None, 0.0)
    return {"status": "measured", "windows": 1, "tensors": len(peaks), "fp16_max": FP16_MAX,
            "largest": {"tensor": largest[0], "max_abs": largest[1]}, "n_over": len(over),
            "over": [{"tensor": n, "max_abs": m} for n, m in over[:top]], "mask_sentinels": len(masks)}


def _fp16_variant(fp32_path: Path, out: Path, convert, window: np.ndarray | None = None) -> Variant:
    try:
        convert(fp32_path, out)
    except QuantnormError as exc:
        return Variant(FP16, None, f"broken: {exc}")
    settings: dict = {"conversion": "quantnorm.quantize.fp16 (float32 inputs/outputs)"}
    if window is not None:
        settings["fp16_range"] = fp16_range(fp32_path, window)
    return Variant(FP16, out, settings=settings)


def prepare_extra(cfg: GpuBenchConfig) -> list[ModelGroup]:
    """The ``--onnx`` files, grouped by directory: a group's FP32 file is its reference, and an
    FP16 copy of it is made in the work directory. INT8 files are measured as given."""


    groups: dict[Path, list[Path]] = {}
    for path in cfg.extra_onnx:
        groups.setdefault(Path(path).resolve().parent, []).append(Path(path))
    out: list[ModelGroup] = []
    windows = _load_windows(cfg.windows) if cfg.windows is not None else None
    for directory, paths in groups.items():
        name = directory.name
        fp32 = next((p for p in paths if quant_format(p) is None), None)
        sibling = directory / "model.fp32.onnx"
        if fp32 is None and sibling.is_file():
            fp32 = sibling  # an INT8 file's reference: the run directory's FP32 model
        seq, inputs, targets, what = _extra_windows(fp32 or paths[0], windows, cfg)
        variants: list[Variant] = []
        if fp32 is None:
            variants.append(Variant(FP32, None, "broken: no FP32 model given or beside the INT8 files"))
        else:
            variants.append(Variant(FP32, fp32))
            variants.append(_fp16_variant(fp32, Path(cfg.work_dir) / "extra" / name / "model.fp16.onnx",
                                          convert_fp16, inputs[:1]))
        for p in paths:
            if p != fp32:
                variants.append(Variant(f"{INT8}:{p.name}", p))
        output = onnx.load(str(fp32 or paths[0]), load_external_data=False).graph.output[0].name
        out.append(ModelGroup(name, tuple(variants), inputs, targets, what, seq,
                              section={"source": "onnx", "files": [_rel(p) for p in paths], "output": output}))
    return out


def _load_windows(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """``--windows``: a .npz with ``inputs`` [n, seq] (and ``targets`` of the same shape: the
    source's own protocol windows, e.g. quantnorm.sources.tokenized's eval_inputs/eval_targets), or a .npy
    of token windows [n, seq + 1] whose next tokens are the targets."""
    try:
        loaded = np.load(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--windows {path}: cannot read a .npy/.npz array ({exc})") from exc
    if isinstance(loaded, np.lib.npyio.NpzFile):
        if "inputs" not in loaded:
            raise ConfigError(f"--windows {path}: a .npz needs an 'inputs' array (and optionally 'targets')")
        inputs = loaded["inputs"]
        targets = loaded["targets"] if "targets" in loaded else None
    else:
        if loaded.ndim != 2 or loaded.shape[1] < 2:
            raise ConfigError(f"--windows {path}: need token windows [windows, seq >= 2], got shape {loaded.shape}")
        inputs, targets = loaded[:, :-1], loaded[:, 1:]
    for name, arr in (("inputs", inputs), ("targets", targets)):
        if arr is None:
            continue
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer) or 0 in arr.shape:
            raise ConfigError(f"--windows {path}: {name} must be integer [windows, seq], got {arr.dtype} {arr.shape}")
    if targets is not None and targets.shape != inputs.shape:
        raise ConfigError(f"--windows {path}: targets {targets.shape} differ from inputs {inputs.shape}")
    return inputs.astype(np.int64), None if targets is None else targets.astype(np.int64)


def _extra_windows(path: Path, windows: tuple[np.ndarray, np.ndarray | None] | None, cfg: GpuBenchConfig):
    """Token windows for an extra model: ``--windows`` (with targets, so perplexity too), else
    seeded random tokens inside the vocabulary (agreement only: random text has no perplexity)."""

    graph = onnx.load(str(path), load_external_data=False).graph  # shapes only: no weights read

    def dims(value) -> list:
        return [d.dim_value or None for d in value.type.tensor_type.shape.dim]

    vocab = (dims(graph.output[0]) or [None])[-1]
    in_dims = dims(graph.input[0])
    seq_dim = in_dims[1] if len(in_dims) > 1 else None
    if windows is not None:
        inputs, targets = (None if a is None else a[: cfg.eval_windows] for a in windows)
        what = "with their targets" if targets is not None else "(no targets: KL and top-1 only)"
        return inputs.shape[1], inputs, targets, f"{len(inputs)} token windows from {cfg.windows} {what}"
    seq = seq_dim if isinstance(seq_dim, int) else cfg.context
    high = vocab if isinstance(vocab, int) else 256
    ids = np.random.default_rng(0).integers(0, high, size=(min(cfg.eval_windows, 16), seq), dtype=np.int64)
    return seq, ids, None, f"{len(ids)} windows of seeded random tokens (no perplexity; KL and top-1 only)"


# --- accuracy ---------------------------------------------------------------------------------

def token_agreement(ref, other, inputs: np.ndarray, targets: np.ndarray | None, batch_size: int = 8) -> dict:
    """KL(p_ref || p_other) mean/p99/max, top-1 agreement and (with targets) both perplexities over
    token ids of any vocabulary; ``compare`` does this for the zoo's byte protocol (it refuses
    targets equal to the zoo's BOS id, a valid token elsewhere)."""
    kls, agree, n, nll = [], 0, 0, [0.0, 0.0]
    lo = 0
    for a, b in zip(run_logits(ref, inputs, batch_size), run_logits(other, inputs, batch_size)):
        la, lb = log_softmax(a), log_softmax(b)
        kls.append(np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0).ravel())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0] * a.shape[1]
        if targets is not None:
            t = targets[lo:lo + a.shape[0]][..., None]
            nll[0] -= float(np.take_along_axis(la, t, -1).sum())
            nll[1] -= float(np.take_along_axis(lb, t, -1).sum())
        lo += a.shape[0]
    kl = np.concatenate(kls)
    out = {"kld_mean": float(kl.mean()), "kld_p99": float(np.percentile(kl, 99)), "kld_max": float(kl.max()),
           "top1_agreement": agree / n, "n_scored": n}
    if targets is not None:
        ppl_ref, ppl = float(np.exp(nll[0] / n)), float(np.exp(nll[1] / n))
        out = {"ppl_fp32": ppl_ref, "ppl_int8": ppl, "ppl_ratio": ppl / ppl_ref, **out}
    return out


def measure_accuracy(group: ModelGroup, variant: Variant, ref_spec: SessionSpec, spec: SessionSpec) -> dict:
    """The variant against the FP32 model on the same provider: ``{"status": "measured", ...}``,
    ``not measured: <why>`` (the provider refused) or ``broken: <why>`` (e.g. non-finite logits)."""
    output = group.section.get("output", "logits")
    if output != "logits":
        # An encoder's first output is a hidden state: a softmax over it would be a number, not a metric.
        return {"status": NOT_MEASURED + f"the model's first output is {output!r}, not next-token logits"}
    try:
        ref = make_session(group.variant(FP32).path, ref_spec)
        sess = make_session(variant.path, spec)
        if group.zoo:
            acc = compare(ref, sess, group.inputs, group.targets, batch_size=8).to_dict()
        else:
            acc = token_agreement(ref, sess, group.inputs, group.targets)
    except ProviderUnavailable as exc:
        return {"status": NOT_MEASURED + str(exc)}
    except MeasureError as exc:
        return {"status": f"broken: {exc}"}
    return {"status": "measured", **acc}


# --- the run ----------------------------------------------------------------------------------

_SHORT = {CPU: "CPU", CUDA: "CUDA", TENSORRT: "TensorRT"}


def _rel(path: Path | None) -> str | None:
    """A path relative to the working directory when it lies below it (results.json names no
    absolute paths of the machine it ran on where it can help it), else as given."""
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _short(provider: str) -> str:
    return _SHORT.get(provider, provider.replace("ExecutionProvider", ""))


def _input_name(path: Path) -> str:

    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def engine_build(path: Path, spec: SessionSpec, batches: tuple[int, ...], seq: int) -> dict:
    """Session creation plus the first run at every batch size, from an empty engine cache: for
    TensorRT that is the engine build (it builds on the first run of a shape profile)."""

    start = time.perf_counter()
    session = make_session(path, spec)
    created = time.perf_counter() - start
    first_runs = {}
    for batch in batches:
        t0 = time.perf_counter()
        session.run(None, random_input_ids(session, batch, seq))
        first_runs[str(batch)] = round(time.perf_counter() - t0, 3)
    return {"status": "measured", "session_create_s": round(created, 3), "first_run_s": first_runs,
            "engine_build_s": round(time.perf_counter() - start, 3)}


def measure_group(group: ModelGroup, cfg: GpuBenchConfig, reasons: dict[str, str | None], budget: Budget,
                  cache_root: Path) -> tuple[list[dict], list[LatencyRow], list[dict]]:
    """Accuracy entries, latency rows and engine builds of one model group on every provider."""
    accuracy: list[dict] = []
    rows: list[LatencyRow] = []
    builds: list[dict] = []
    fp32 = group.variant(FP32)
    max_batch = max(cfg.batches)
    # GPU providers first: when the budget runs out, it is the CPU reference that is cut, not
    # the numbers the lease was for.
    for provider in sorted(cfg.providers, key=lambda p: p == CPU):
        base_spec = SessionSpec(provider=provider)
        specs: dict[str, SessionSpec] = {}
        for variant in group.variants:
            if variant.path is None:
                continue
            if provider == TENSORRT:
                kind = INT8 if variant.name.startswith(INT8) else variant.name
                cache = cache_root / f"{group.name}-{variant.name.replace(':', '_')}"
                cache.mkdir(parents=True, exist_ok=True)
                # TensorRT optimizes the subgraphs it takes itself; ORT's own passes (constant folding
                # of a weight's DequantizeLinear, fusions into contrib ops) could only hide the Q/DQ
                # pattern it builds INT8 from, so they are off for every TensorRT session (as in
                # Optimum's TensorRT INT8 example). results.json records the level with each entry.
                specs[variant.name] = EngineSpec(provider=provider, graph_optimization_level="disable",
                                                 options=trt_options(kind, _input_name(variant.path), group.seq,
                                                                     max_batch, cache))
            else:
                specs[variant.name] = base_spec
        for variant in group.variants:
            entry = {"model": group.name, "name": variant.name, "path": _rel(variant.path),
                     "settings": variant.settings, "session": (specs.get(variant.name) or base_spec).to_dict()}
            reason = reasons[provider] or budget.spent()
            if variant.path is None:
                entry["status"] = variant.status
                accuracy.append(entry)
                continue
            entry["size_bytes"] = variant.path.stat().st_size
            spec = specs[variant.name]
            if reason is not None:
                entry["status"], entry["accuracy"] = "ok", {"status": NOT_MEASURED + reason}
                accuracy.append(entry)
                rows += [not_measured(provider, variant.name, b, group.seq, reason, size_bytes=entry["size_bytes"])
                         for b in cfg.batches]
                if provider == TENSORRT:
                    builds.append({"model": group.name, "variant": variant.name, "status": NOT_MEASURED + reason})
                continue
            if provider == TENSORRT:
                try:
                    build = engine_build(variant.path, spec, cfg.batches, group.seq)
                except ProviderUnavailable as exc:
                    build = {"status": NOT_MEASURED + str(exc)}
                except Exception as exc:  # noqa: BLE001 -- a failed engine build is a result for this cell only
                    build = {"status": f"broken: {' '.join(str(exc).split())[:300]}"}
                builds.append({"model": group.name, "variant": variant.name, **build})
            if fp32 is not None and fp32.path is not None:
                entry["status"] = "ok"
                entry["accuracy"] = measure_accuracy(group, variant, specs[FP32], spec)
                if variant.name == FP32:  # its own reference: record only its perplexity
                    entry["accuracy"] = {k: v for k, v in entry["accuracy"].items()
                                         if k in ("status", "ppl_fp32", "bits_per_byte_fp32", "n_scored")}
            else:
                entry["status"] = "ok"
                entry["accuracy"] = {"status": NOT_MEASURED + "no FP32 reference"}
            if provider == CPU and variant.name == FP16:
                entry["note"] = "ORT's CPU provider computes float16 ops in float32: no overflow shows here"
            accuracy.append(entry)
            placement: LatencyRow | None = None
            for batch in cfg.batches:
                spent = budget.spent()
                if spent:
                    rows.append(not_measured(provider, variant.name, batch, group.seq, spent))
                    continue
                try:
                    on_cpu = provider == CPU
                    row = bench_model(variant.path, variant=variant.name, spec=spec, batch=batch, seq=group.seq,
                                      warmup=cfg.cpu_warmup if on_cpu else cfg.warmup,
                                      iters=cfg.cpu_iters if on_cpu else cfg.iters, progress=cfg.progress,
                                      record_placement=placement is None)
                except MeasureError as exc:
                    row = not_measured(provider, variant.name, batch, group.seq, f"run failed: {exc}")
                if row.measured:
                    # Placement does not change with the batch: profiled once, copied to the others.
                    if placement is None:
                        placement = row
                    elif row.node_providers is None:
                        row = replace(row, node_providers=placement.node_providers, node_ops=placement.node_ops)
                rows.append(row)
    return accuracy, rows, builds


def run_gpu_bench(cfg: GpuBenchConfig, *, command: str) -> dict:
    """Prepare the models, measure them on every provider, write results.json and report.md."""

    stage: dict[str, float] = {}
    # The budget covers the whole run (training and exports too): what the lease must fit.
    budget = Budget(cfg.budget_s)
    t0 = budget.start
    install = install_section()
    reasons = provider_reasons(cfg.providers, install)
    groups: list[ModelGroup] = []
    if cfg.zoo:
        groups.append(prepare_zoo(cfg))
    groups += prepare_extra(cfg)
    stage["prepare"] = round(time.perf_counter() - t0, 2)
    t1 = time.perf_counter()
    recipes, latency, builds = [], [], []
    with tempfile.TemporaryDirectory(prefix="quantnorm-trt-") as cache_root:
        for group in groups:
            acc, rows, eng = measure_group(group, cfg, reasons, budget, Path(cache_root))
            recipes += acc
            latency += [{"model": group.name, **r.to_dict()} for r in rows]
            builds += eng
    stage["measure"] = round(time.perf_counter() - t1, 2)

    zoo = next((g for g in groups if g.zoo), None)
    results = {
        **results_header(command, None),
        "gpu": gpu_section(),
        "install": install,
        "providers_status": {p: reasons[p] or "usable" for p in cfg.providers},
        "model": zoo.section if zoo else groups[0].section,
        "models": [{"name": g.name, **g.section, "windows": g.windows, "seq": g.seq,
                    "variants": [{"name": v.name, "path": _rel(v.path), "status": v.status}
                                 for v in g.variants]} for g in groups],
        "settings": {"batches": list(cfg.batches), "iters": cfg.iters, "warmup": cfg.warmup,
                     "cpu_iters": cfg.cpu_iters, "cpu_warmup": cfg.cpu_warmup,
                     "eval_windows": cfg.eval_windows, "int8_recipe": cfg.int8_recipe, "budget_s": cfg.budget_s},
        # The FP32 models are the references, not recipes: the gate would judge them otherwise.
        "references": [e for e in recipes if e["name"] == FP32],
        "recipes": [e for e in recipes if e["name"] != FP32],
        "latency": latency,
        "engine_builds": builds,
        "stage_seconds": stage,
    }
    out = Path(cfg.out_dir)
    write_json_atomic(out / RESULTS_NAME, results)
    write_text_atomic(out / REPORT_NAME, render_report(results))
    return results


# --- output -------------------------------------------------------------------------------------

def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _placement(row: dict) -> str:
    nodes = row.get("node_providers") or {}
    return " ".join(f"{_short(p)}:{n}" for p, n in nodes.items()) or "-"


def _entries(results: dict) -> list[dict]:
    """References and recipes in the order they were measured: model, provider, then variant."""
    models = [m["name"] for m in results.get("models", [])]
    providers = list(PROVIDERS.values())

    def key(e: dict) -> tuple:
        model = models.index(e["model"]) if e["model"] in models else len(models)
        provider = e["session"]["provider"]
        return model, providers.index(provider) if provider in providers else len(providers), e["name"] != FP32

    return sorted([*results.get("references", []), *results["recipes"]], key=key)  # stable: variant order kept


def summary_table(results: dict) -> list[str]:
    """One line per model x variant x provider: p50 per batch, accuracy, node placement."""
    batches = results["settings"]["batches"]
    head = f"{'model/variant':<24} {'provider':<9}" + "".join(f" {'p50 b' + str(b):>9}" for b in batches) + \
           f" {'ppl ratio':>9} {'top-1':>6} {'build s':>7}  nodes"
    lines = [head, "-" * len(head)]
    rows: dict[tuple, dict[int, dict]] = {}
    for r in results["latency"]:
        rows.setdefault((r["model"], r["variant"], r["provider"]), {})[r["batch"]] = r
    builds = {(b["model"], b["variant"]): b for b in results.get("engine_builds", [])}
    for entry in _entries(results):
        key = (entry["model"], entry["name"], entry["session"]["provider"])
        label = f"{entry['model']}/{entry['name']}"[:24]
        prov = _short(key[2])
        if entry.get("status", "ok") != "ok":
            lines.append(f"{label:<24} {prov:<9} {entry['status']}"[:140])
            continue
        cells = rows.get(key, {})
        measured = [c for c in cells.values() if c["status"] == "measured"]
        if not measured:
            status = next((c["status"] for c in cells.values()), entry.get("accuracy", {}).get("status", ""))
            lines.append(f"{label:<24} {prov:<9} {status}"[:140])
            continue
        acc = entry.get("accuracy", {})
        p50 = "".join(f" {_fmt(cells.get(b, {}).get('p50_ms')):>9}" for b in batches)
        ratio = acc.get("ppl_ratio") if acc.get("status") == "measured" else None
        top1 = acc.get("top1_agreement") if acc.get("status") == "measured" else None
        build = builds.get((entry["model"], entry["name"])) if key[2] == TENSORRT else None
        bs = build.get("engine_build_s") if build else None
        tag = " (simulated INT8)" if any(c.get("simulated_int8") for c in measured) else ""
        if acc.get("status", "measured") != "measured":
            tag += f" accuracy {acc['status']}"[:60]
        rng = entry.get("settings", {}).get("fp16_range", {})
        if rng.get("n_over"):
            tag += f" ({rng['n_over']} FP32 tensors past 65504)"
        lines.append(f"{label:<24} {prov:<9}{p50} {_fmt(ratio, '.4f'):>9} {_fmt(top1, '.3f'):>6} "
                     f"{_fmt(bs, '.1f'):>7}  {_placement(measured[0])}{tag}")
    return lines


def render_report(results: dict) -> str:
    """report.md: what ran where, the one-screen table, then every latency row and engine build."""
    hw, gpu = results["hardware"], results["gpu"]
    names = ", ".join(f"{g['name']} (driver {g['driver']}, {g['memory']}, cc {g['compute_capability']})"
                      for g in gpu["gpus"]) or "none visible"
    lines = [
        "# GPU benchmark: FP32, FP16 and INT8 on the CUDA and TensorRT providers",
        "",
        f"Command: `{results['command']}`  ",
        f"Created: {results['created']}  ",
        f"GPU: {names}  ",
        f"CPU: {hw['cpu']} ({hw['cpu_count']} CPUs); onnxruntime {hw['onnxruntime']}  ",
        "Libraries: " + (", ".join(f"{k} {v}" for k, v in gpu["libraries"].items()) or "none found")
        + f"; onnxruntime built for CUDA {gpu.get('onnxruntime_cuda') or '-'}, torch for CUDA {gpu.get('torch_cuda') or '-'}",
        "",
        "Providers: " + "; ".join(f"{_short(p)}: {s}" for p, s in results["providers_status"].items()),
        "",
        "Accuracy is each variant against the FP32 model on the *same* provider; p50 in ms per batch size;"
        " 'nodes' is which provider ran the nodes (ORT profile). On CUDA a QDQ model is simulated INT8"
        " (float math between Q/DQ); real INT8 is TensorRT's (`trt_int8_enable`), FP16 engines use"
        " `trt_fp16_enable`. The FP32 model runs with each provider's default math settings (whether a GPU"
        " MatMul may use TF32 is not set here), so the FP32 reference is the same one every variant on that"
        " provider is read against. A row that could not run says why and carries no number.",
        "",
    ]
    for m in results["models"]:
        trained = m.get("train") or {}
        how = (f"; {m['n_layers']} layers, d_model {m['d_model']}, {m['steps']} steps, "
               f"{trained.get('eval_bits_per_byte', float('nan')):.3f} bits/byte ({trained.get('status', '?')})"
               if "n_layers" in m else "")
        lines.append(f"- model `{m['name']}`: {m['windows']}; sequence {m['seq']}{how}")
    lines += ["", "```", *summary_table(results), "```", "", "## Latency", "",
              "| model | variant | provider | batch | status | p50 ms | p90 ms | p99 ms | tokens/s | nodes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["latency"]:
        lines.append(f"| {r['model']} | {r['variant']} | {_short(r['provider'])} | {r['batch']} | {r['status']} | "
                     f"{_fmt(r.get('p50_ms'))} | {_fmt(r.get('p90_ms'))} | {_fmt(r.get('p99_ms'))} | "
                     f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_placement(r)} |")
    lines += ["", "## TensorRT engine builds (session creation + first run per batch, empty cache)", "",
              "| model | variant | status | build s |", "|---|---|---|---|"]
    for b in results["engine_builds"]:
        lines.append(f"| {b['model']} | {b['variant']} | {b['status']} | {_fmt(b.get('engine_build_s'), '.2f')} |")
    lines += ["", "## Accuracy against FP32 on the same provider", "",
              "| model | variant | provider | status | PPL ratio | KL mean | KL p99 | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for e in _entries(results):
        a = e.get("accuracy", {})
        lines.append(f"| {e['model']} | {e['name']} | {_short(e['session']['provider'])} | "
                     f"{a.get('status', e.get('status'))} | {_fmt(a.get('ppl_ratio'), '.4f')} | "
                     f"{_fmt(a.get('kld_mean'), '.2e')} | {_fmt(a.get('kld_p99'), '.2e')} | "
                     f"{_fmt(a.get('top1_agreement'), '.4f')} |")
    lines += ["", "## FP16 range of the FP32 models (one window, CPU)", "",
              "Tensors whose largest |value| passes float16's 65504 overflow in the FP16 variant on a GPU"
              " (the CPU provider computes float16 in float32 and hides it).", ""]
    seen: set[str] = set()
    for e in results["recipes"]:
        rng = e.get("settings", {}).get("fp16_range")
        if e["name"] != FP16 or not rng or e["model"] in seen:
            continue
        seen.add(e["model"])
        if rng.get("status") != "measured":
            lines.append(f"- `{e['model']}`: {rng.get('status')}")
            continue
        over = ", ".join(f"`{o['tensor']}` {o['max_abs']:.4g}" for o in rng["over"]) or "none"
        lines.append(f"- `{e['model']}`: {rng['n_over']} of {rng['tensors']} tensors past 65504 ({over}); largest"
                     f" `{rng['largest']['tensor']}` {rng['largest']['max_abs']:.4g}"
                     + (f"; {rng['mask_sentinels']} attention-mask tensors at float32's limit (clipped, harmless)"
                        if rng.get("mask_sentinels") else ""))
    lines += ["", f"Stage seconds: {results['stage_seconds']}", ""]
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------

def _cli():

    @click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
    @click.option("--out", type=click.Path(path_type=Path), default=Path("reports/gpu"), show_default=True,
                  help="Where results.json and report.md go.")
    @click.option("--work-dir", type=click.Path(path_type=Path), default=Path("runs/gpu-zoo"), show_default=True,
                  help="The zoo model's run directory (trained here when absent) and its ONNX variants.")
    @click.option("--onnx", "extra", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
                  help="Extra ONNX model (a run directory's model.fp32.onnx or model.int8.*.onnx); repeatable.")
    @click.option("--windows", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
                  help="Token windows for the --onnx models' accuracy: .npz with inputs (and targets) [n, seq], or "
                       ".npy [n, seq+1] (next tokens are the targets). [default: random tokens, no perplexity]")
    @click.option("--no-zoo", is_flag=True, help="Measure only the --onnx models.")
    @click.option("--providers", default="cpu,cuda,tensorrt", show_default=True, help="Comma-separated.")
    @click.option("--batches", default="1,8,32", show_default=True, help="Batch sizes.")
    @click.option("--iters", type=int, default=50, show_default=True, help="Timed runs per cell.")
    @click.option("--warmup", type=int, default=10, show_default=True, help="Untimed runs per cell.")
    @click.option("--cpu-iters", type=int, default=20, show_default=True, help="Timed runs per CPU reference cell.")
    @click.option("--cpu-warmup", type=int, default=3, show_default=True, help="Untimed runs per CPU reference cell.")
    @click.option("--steps", type=int, default=150, show_default=True, help="Training steps of the zoo model.")
    @click.option("--layers", type=int, default=4, show_default=True)
    @click.option("--d-model", type=int, default=128, show_default=True)
    @click.option("--heads", type=int, default=4, show_default=True)
    @click.option("--context", type=int, default=128, show_default=True)
    @click.option("--eval-windows", type=int, default=64, show_default=True, help="Windows the accuracy is read on.")
    @click.option("--int8-recipe", default="static-minmax-matmul-symact", show_default=True,
                  help="Recipe of the INT8 variant (signed symmetric: what TensorRT runs as real INT8).")
    @click.option("--budget-s", type=float, default=330.0, show_default=True,
                  help="Seconds for the whole run; cells past it are recorded as not measured.")
    @click.option("--quiet", is_flag=True, help="No progress bars.")
    @click.option("--debug", is_flag=True, help="Full tracebacks instead of one-line errors.")
    def main(out, work_dir, extra, windows, no_zoo, providers, batches, iters, warmup, cpu_iters, cpu_warmup, steps,
             layers, d_model, heads, context, eval_windows, int8_recipe, budget_s, quiet, debug):
        """FP32/FP16/INT8 on the CUDA and TensorRT providers (CPU as reference); writes OUT/results.json,
        OUT/report.md and prints a one-screen table. Exits 0 when a provider cannot run (its rows say why)."""
        try:
            cfg = GpuBenchConfig(
                out_dir=out, work_dir=work_dir, extra_onnx=tuple(extra), windows=windows, zoo=not no_zoo,
                providers=tuple(p.strip().lower() for p in providers.split(",") if p.strip()),
                batches=tuple(int(b) for b in batches.split(",") if b.strip()), iters=iters, warmup=warmup,
                cpu_iters=cpu_iters, cpu_warmup=cpu_warmup,
                steps=steps, layers=layers, d_model=d_model, heads=heads, context=context,
                eval_windows=eval_windows, int8_recipe=int8_recipe, budget_s=budget_s, progress=not quiet)
            # gpu.sh passes its own command line: that is what reproduces the run, installs included.
            command = os.environ.get("QUANTNORM_GPU_COMMAND") or "python -m quantnorm.gpu_bench " + " ".join(sys.argv[1:])
            results = run_gpu_bench(cfg, command=command)
        except (QuantnormError, ValueError) as exc:
            if debug:
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        click.echo("\n".join(summary_table(results)))
        click.echo(f"wrote {Path(out) / RESULTS_NAME} and {Path(out) / REPORT_NAME}")

    return main


def main(argv: list[str] | None = None) -> None:
    _cli()(args=argv)


if __name__ == "__main__":
    main()
