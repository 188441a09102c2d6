"""ONNX Runtime sessions that are what they say they are.

onnxruntime-gpu lists the CUDA and TensorRT providers even where no GPU or CUDA library exists,
and a session asked for them quietly runs on the CPU (pitfall 3). Everything here therefore
checks the providers a session actually got, and turns a fallback into ``ProviderUnavailable``
so that no CPU timing is ever labelled as a GPU one. ``hardware_info`` (results.json's hardware
section) lives here for the same reason: it records which providers really load.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import ConfigError, MeasureError
from ..fileio import atomic_path, release_memory, save_onnx, serialized_size_estimate
from ..hardware import (
    available_cpus,
    cpu_caches,
    cpu_flags,
    cpu_has_vnni,
    cpu_id,
    cpu_model,
    gpu_details,
    gpu_device_present,
    gpu_names,
)
from ..providers import CPU, CUDA, PROVIDERS, TENSORRT, short_provider
from ..unsigned_weights import has_signed_weight_ops, to_unsigned

# Providers tried after the requested one, for the nodes it cannot run. CPU always comes last;
# TensorRT hands what it rejects to CUDA first (the usual ORT setup), so they stay on the GPU.
_FALLBACK_CHAIN: dict[str, tuple[str, ...]] = {
    CPU: (),
    CUDA: (CPU,),
    TENSORRT: (CUDA, CPU),
}

OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# results.json records the ORT spelling ("ORT_ENABLE_ALL"); accept both spellings on input.
_OPT_BY_ORT_NAME = {level.name: level for level in OPT_LEVELS.values()}


class ProviderUnavailable(MeasureError):
    """The requested execution provider cannot run here (no device, missing libraries, fell back)."""


def normalize_provider(name: str) -> str:
    """A short name (``cpu``, ``cuda``, ``tensorrt``) or an ORT name -> the ORT name."""
    key = name.strip()
    if key.lower() in PROVIDERS:
        return PROVIDERS[key.lower()]
    if key in PROVIDERS.values():
        return key
    choices = ", ".join(f"{short} ({full})" for short, full in PROVIDERS.items())
    raise ConfigError(f"unknown execution provider {name!r}: choose one of {choices}")


def listed_providers() -> list[str]:
    """The providers this onnxruntime build lists, in ``PROVIDERS`` order: the default of
    ``--providers`` (a listed one that cannot run here gets a "not measured: why" row)."""
    listed = set(ort.get_available_providers())
    return [p for p in PROVIDERS.values() if p in listed]


def normalize_opt_level(name: str) -> str:
    """A short name (``disable``/``basic``/``extended``/``all``) or an ORT name -> the ORT name."""
    key = name.strip()
    if key.lower() in OPT_LEVELS:
        return OPT_LEVELS[key.lower()].name
    if key.upper() in _OPT_BY_ORT_NAME:
        return key.upper()
    choices = ", ".join(f"{short} ({level.name})" for short, level in OPT_LEVELS.items())
    raise ConfigError(f"unknown graph optimization level {name!r}: choose one of {choices}")


@dataclass(frozen=True)
class SessionSpec:
    """How a model is run: provider, graph optimization level, intra-op threads (None: ORT default).

    Accuracy must be measured with the options used in deployment (pitfall 2), so FP32 and INT8
    share one spec, and results.json records it next to every number.
    """

    provider: str = CPU
    graph_optimization_level: str = "ORT_ENABLE_ALL"
    threads: int | None = None
    # Two sessions that take turns in one process (a split deployment's prompt and token graphs)
    # each have a thread pool whose workers spin after a run; on a 2-core CPU the idle one's
    # spinning took a third of the other's prefill. True: workers stop spinning when a run returns.
    stop_spinning: bool = False

    def __post_init__(self) -> None:
        # Frozen: store the canonical spellings through object.__setattr__.
        object.__setattr__(self, "provider", normalize_provider(self.provider))
        object.__setattr__(self, "graph_optimization_level", normalize_opt_level(self.graph_optimization_level))
        if self.threads is not None and (isinstance(self.threads, bool) or int(self.threads) < 1):
            raise ConfigError(f"threads must be >= 1 (or omitted for the ONNX Runtime default), got {self.threads}")

    @property
    def providers(self) -> list[str]:
        """The provider list handed to ORT: the requested one first, CPU last."""
        return [self.provider, *_FALLBACK_CHAIN[self.provider]]

    def to_dict(self) -> dict:
        out = {"provider": self.provider, "graph_optimization_level": self.graph_optimization_level,
               "threads": self.threads}
        return {**out, "stop_spinning": True} if self.stop_spinning else out

    def session_options(self) -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = _OPT_BY_ORT_NAME[self.graph_optimization_level]
        if self.threads is not None:
            opts.intra_op_num_threads = int(self.threads)
        # One graph, run sequentially: inter-op threads would only add noise to timings.
        opts.inter_op_num_threads = 1
        # Errors only: ORT's warnings (e.g. "some nodes were not assigned to the preferred EP")
        # are reported by node_placement as numbers instead.
        opts.log_severity_level = 3
        if self.stop_spinning:
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        return opts


def resolve_providers(names: list[str] | None) -> list[str]:
    """Short or ORT provider names -> ORT names (duplicates dropped, order kept).

    None means every provider that is usable here (always includes CPU). An unknown name is a
    ConfigError that lists the choices; a known but unusable one is kept, so that the benchmark
    can say why it was not measured.
    """
    if names is None:
        return [p for p in PROVIDERS.values() if provider_status(p) is None]
    resolved: list[str] = []
    for name in names:
        full = normalize_provider(name)
        if full not in resolved:
            resolved.append(full)
    return resolved


# --- provider probing -----------------------------------------------------------------------

_STATUS_CACHE: dict[str, str | None] = {}


@contextmanager
def _capture_native_output() -> Iterator[list[str]]:
    """Redirect file descriptors 1 and 2 (where ORT's C++ logger and its Python fallback notice
    write) into a temporary file; the list receives the captured text on exit.

    A probe that fails is expected, and its "EP Error" banner would only alarm the user; the text
    is still used to explain why the provider is unusable.
    """
    captured: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield captured
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            captured.append(sink.read().decode("utf-8", errors="replace"))


def _probe_model_bytes() -> bytes:
    """A one-node float model (y = x + x): every provider can run it, and it builds in no time."""
    from onnx import TensorProto, helper  # ~1 s to import (ml_dtypes): the gate imports this module without it

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every ORT this project supports
    return model.SerializeToString()


def _reason_from_log(text: str) -> str | None:
    """A short reason from ORT's failure log, e.g. 'missing library libcublasLt.so.13'."""
    missing = re.search(r"error: (lib[\w.\-+]+\.so[\w.]*): cannot open shared object file", text)
    if missing:
        return f"missing library {missing.group(1)}"
    require = re.search(r"(Require cuDNN[^.]*\.[^.]*\.\*)", text)
    if require:
        return require.group(1)
    return None


def _probe(provider: str) -> str | None:
    """Create a tiny session with ``provider`` and report why it did not load, or None."""
    chain = [provider, *_FALLBACK_CHAIN[provider]]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    error: str | None = None
    actual: list[str] = []
    with _capture_native_output() as log:
        try:
            sess = ort.InferenceSession(_probe_model_bytes(), opts, providers=chain, enable_fallback=0)
            actual = list(sess.get_providers())
            if actual and actual[0] == provider:
                sess.run(None, {"x": np.ones((1, 4), dtype=np.float32)})
        except Exception as exc:  # noqa: BLE001 -- any failure means "not usable"; the message says why
            error = one_line(exc)
    text = log[0] if log else ""
    if error is None and actual and actual[0] == provider:
        return None
    why = _reason_from_log(text) or _reason_from_log(error or "") or error
    short = short_provider(provider)
    return f"{short} provider failed to load ({why})" if why else f"{short} provider did not load (ORT fell back to {actual})"


def provider_status(provider: str) -> str | None:
    """None when ``provider`` is usable here, else a short reason (``"no CUDA device"``, ...).

    Cached per process. CUDA and TensorRT need a visible NVIDIA GPU (nvidia-smi or a driver
    device node) and must really load on a tiny probe session: the wheel lists them either way.
    """
    provider = normalize_provider(provider)
    if provider in _STATUS_CACHE:
        return _STATUS_CACHE[provider]
    status: str | None
    if provider == CPU:
        status = None
    elif provider not in ort.get_available_providers():
        status = f"not built into this onnxruntime {ort.__version__} (available: {', '.join(ort.get_available_providers())})"
    elif provider in (CUDA, TENSORRT) and not gpu_device_present():
        status = "no CUDA device"
    else:
        status = _probe(provider)
    _STATUS_CACHE[provider] = status
    return status


# --- the results.json hardware section ----------------------------------------------------

def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 -- a broken optional install must not stop the report
        return None
    return getattr(mod, "__version__", None)


UNSIGNED_AT_LOAD = ("int8 weight codes against uint8 activations run as uint8 (code + 128) in every CPU session: "
                    "the same integers, without the u8 x s8 kernel's int16 saturation on a CPU without VNNI")


def hardware_info(threads: int | None = None, *, probe_providers: bool = True) -> dict:
    """The ``hardware`` section of ``results.json``.

    ``threads`` is the intra-op thread count the measurements used; when None (ONNX Runtime's own
    default) the number of CPUs available to the process is recorded instead, and ``cpu_count``
    always says how many there were. With ``probe_providers`` each listed provider is checked
    (a tiny session per GPU provider, cached) and ``providers_status`` says why one is unusable.
    """
    available = list(ort.get_available_providers())
    names = gpu_names()
    info: dict = {
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cpu_caches": cpu_caches(),
        "cpu_flags": cpu_flags(),
        "vnni": (vnni := cpu_has_vnni()),
        **({} if vnni else {"int8_weights": UNSIGNED_AT_LOAD}),
        "threads": threads if threads is not None else available_cpus(),
        "cpu_count": available_cpus(),
        "onnxruntime": ort.__version__,
        "torch": _version("torch"),
        "onnx": _version("onnx"),
        "numpy": _version("numpy"),
        "python": platform.python_version(),
        "providers_available": available,
        "gpu": ", ".join(names) if names else None,
        "os": platform.platform(),
    }
    details = gpu_details() if names else None
    if details is not None:
        info["gpu_details"] = details
    if probe_providers:
        # "usable" or the reason: get_available_providers() lists what the wheel was built with,
        # not what works here (pitfall 3).
        info["providers_status"] = {p: provider_status(p) or "usable" for p in available}
    return info


# --- sessions -------------------------------------------------------------------------------

_MODEL_ERRORS = ("InvalidProtobuf", "InvalidGraph", "InvalidArgument", "NoSuchFile", "NotImplemented")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, without ORT's '[ONNXRuntimeError] : 7 : X :' prefix."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    return text[:300] + ("..." if len(text) > 300 else "")


def make_session(path: str | os.PathLike, spec: SessionSpec, *, profile: bool = False,
                 profile_prefix: str | os.PathLike | None = None, exact_int8: bool = True) -> ort.InferenceSession:
    """An ORT session for the model at ``path`` that really runs on ``spec.provider``.

    Raises MeasureError (one line naming the file) when the file is missing, truncated or not an
    ONNX model, and ProviderUnavailable when the provider cannot run here or ORT fell back to
    another one. ``profile`` turns on ORT's JSON profiler (files start with ``profile_prefix``).
    ``exact_int8``: on a CPU without VNNI, int8 weight codes multiplied with uint8 activations
    (a model quantized on a VNNI CPU) run as unsigned ones, the same integers without the u8 x s8
    kernel's saturation (``unsigned_weights``); False runs the file's own codes.
    """
    path = Path(path)
    if not path.is_file():
        raise MeasureError(f"model file not found: {path}")
    if path.stat().st_size == 0:
        raise MeasureError(f"model file is empty: {path} (re-run the export/quantize step)")
    status = provider_status(spec.provider)
    if status is not None:
        raise ProviderUnavailable(f"{spec.provider} is unavailable: {status}")
    opts = spec.session_options()
    providers = spec.providers
    if spec.provider == TENSORRT:
        providers = [(TENSORRT, tensorrt_options(path)), *providers[1:]]
        # TensorRT optimizes what it takes; ORT's own fusions could hide the Q/DQ pattern it
        # builds INT8 engines from (the latency row's note says so).
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if profile:
        opts.enable_profiling = True
        if profile_prefix is not None:
            opts.profile_file_prefix = str(profile_prefix)
    try:
        with _session_source(path, exact_int8 and spec.provider == CPU and not cpu_has_vnni()) as source:
            # enable_fallback=0: a provider error raises instead of silently retrying on the CPU.
            session = ort.InferenceSession(source, opts, providers=providers, enable_fallback=0)
    except Exception as exc:
        kind = type(exc).__name__
        if kind in _MODEL_ERRORS or spec.provider == CPU:
            raise MeasureError(
                f"cannot load ONNX model {path}: {one_line(exc)} (the file is truncated, corrupt or not an "
                f"ONNX model; re-run the export/quantize step)"
            ) from exc
        raise ProviderUnavailable(f"{spec.provider} failed to create a session for {path}: {one_line(exc)}") from exc
    actual = list(session.get_providers())
    if not actual or actual[0] != spec.provider:
        raise ProviderUnavailable(f"{spec.provider} was requested for {path} but ONNX Runtime loaded {actual}")
    return session


@contextmanager
def _session_source(path: Path, unsigned: bool) -> Iterator[str | bytes]:
    """What ORT loads: the file, or (``unsigned``, where the file has int8 weights against uint8
    activations) the model with those stored unsigned: its bytes, or a temporary copy past 2 GB."""
    model = None
    if unsigned and has_signed_weight_ops(path):
        import onnx

        model = onnx.load(str(path))
        if to_unsigned(model) == 0:
            model = None
    if model is None:
        yield str(path)
    elif serialized_size_estimate(model) < INT8_REWRITE_IN_MEMORY_BYTES:
        yield model.SerializeToString()
    else:
        with tempfile.TemporaryDirectory(prefix="quantnorm-unsigned-") as tmp:
            copy = Path(tmp) / path.name
            save_onnx(model, copy)
            del model
            yield str(copy)


# A rewritten model below this size is handed to ORT as bytes (protobuf's limit is 2 GiB).
INT8_REWRITE_IN_MEMORY_BYTES = 1 << 30


def tensorrt_options(path: str | os.PathLike) -> dict[str, str]:
    """TensorRT's precision flags for the model at ``path``: ``trt_int8_enable`` for a Q/DQ graph
    (TensorRT builds real INT8 engines from its Q/DQ pairs), ``trt_fp16_enable`` for a float16
    graph; an FP32 graph gets neither (TensorRT would otherwise keep FP32 kernels anyway)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    if ops & {"QuantizeLinear", "DequantizeLinear"}:
        return {"trt_int8_enable": "True"}
    if any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer):
        return {"trt_fp16_enable": "True"}
    return {}


class ReopenableSession:
    """A ``make_session`` session opened on first use and let go by ``close()``, so the weights
    it holds (an FP32 Gemma 3 270M: 1 GB of initializers plus ORT's pre-packed copies) are not
    resident while another stage needs the memory (the quantizer's own sessions); the next call
    opens it again. It stands in wherever an ``InferenceSession`` is read (``run``,
    ``get_inputs``, ``get_outputs`` ...)."""

    def __init__(self, path: str | os.PathLike, spec: SessionSpec):
        self.path, self.spec = Path(path), spec
        self._session: ort.InferenceSession | None = None
        self.opened = 0   # how many times it was (re)opened: tests read it

    def _open(self) -> ort.InferenceSession:
        if self._session is None:
            self._session = make_session(self.path, self.spec)
            self.opened += 1
        return self._session

    def __getattr__(self, name: str):
        return getattr(self._open(), name)

    @property
    def is_open(self) -> bool:
        return self._session is not None

    def close(self) -> None:
        if self._session is not None:
            self._session = None
            release_memory(collect_cycles=False)   # the freed arena back to the OS


@dataclass(frozen=True)
class Arg:
    """What a session says of one input or output (ORT's NodeArg without its session)."""
    name: str
    shape: list
    type: str


class ReplayedSession:
    """Stands in for a session whose outputs on the same inputs are read again and again: the FP32
    model, scored against every recipe and search trial on the same evaluation windows. The first
    ``run`` of a feed computes its outputs and writes them to a temporary folder inside ``parent``
    (one ``.npy`` per output, renamed into place when complete; the folder goes with ``discard()``,
    or with the object); a later ``run`` of the same feed reads them back instead of
    running the model, so the FP32 session (``ReopenableSession``: closed while the quantizer runs)
    is opened once per run, not once per recipe. On Gemma 3 a batch of 8 windows is 1 GiB of logits
    and seconds of FP32 compute; reading it back is a fraction of that. Recording stops (the model
    runs as before) once ``max_bytes`` are on disk or the disk's free space would fall below
    ``keep_free_bytes``. Memory: one run's outputs, as without it."""

    def __init__(self, session, parent: str | os.PathLike, *, max_bytes: int = 32 << 30,
                 keep_free_bytes: int = 4 << 30):
        self.session = session
        self._folder = tempfile.TemporaryDirectory(prefix=f".fp32-outputs-{os.getpid()}-", dir=parent)
        self.folder: Path | None = Path(self._folder.name)
        self.max_bytes, self.keep_free_bytes = int(max_bytes), int(keep_free_bytes)
        self.recorded_bytes = 0
        self.computed = self.replayed = 0   # runs of each kind (tests read them)
        self._inputs = self._outputs = None

    def _key(self, output_names, feed: dict) -> str:
        digest = hashlib.sha256(repr(None if output_names is None else list(output_names)).encode())
        for name in sorted(feed):
            value = np.ascontiguousarray(feed[name])
            digest.update(f"{name}|{value.dtype}|{value.shape}|".encode())
            if value.size:   # an empty cache (past length 0) has no bytes, and memoryview refuses to cast it
                digest.update(memoryview(value).cast("B"))
        return digest.hexdigest()[:32]

    # Read once, as plain copies: every call on a wrapped ReopenableSession would open it, and ORT's
    # NodeArg objects keep their C++ session alive (measured on Gemma 3: 1.7 GB stayed resident
    # after close() while they were held).
    def get_inputs(self) -> list[Arg]:
        if self._inputs is None:
            self._inputs = [Arg(a.name, list(a.shape), a.type) for a in self.session.get_inputs()]
        return self._inputs

    def get_outputs(self) -> list[Arg]:
        if self._outputs is None:
            self._outputs = [Arg(a.name, list(a.shape), a.type) for a in self.session.get_outputs()]
        return self._outputs

    def run(self, output_names, input_feed, run_options=None) -> list:
        if self.folder is None:   # discarded: a plain session from now on
            return self.session.run(output_names, input_feed, run_options)
        key = self._key(output_names, input_feed)
        count = self.folder / f"{key}.n"
        if count.is_file():
            n = int(count.read_text())
            self.replayed += 1
            return [np.load(self.folder / f"{key}.{i}.npy") for i in range(n)]
        outputs = self.session.run(output_names, input_feed, run_options)
        self.computed += 1
        size = sum(np.asarray(o).nbytes for o in outputs)
        if self.recorded_bytes + size <= self.max_bytes and \
                shutil.disk_usage(self.folder).free - size >= self.keep_free_bytes:
            for i, value in enumerate(outputs):
                with atomic_path(self.folder / f"{key}.{i}.npy") as part, open(part, "wb") as f:
                    np.save(f, np.asarray(value), allow_pickle=False)
            count.write_text(str(len(outputs)))   # last: a half-written record is never read
            self.recorded_bytes += size
        return outputs

    def close(self) -> None:
        self.session.close()

    def discard(self) -> None:
        """Delete the recorded outputs (gigabytes on a large vocabulary) and stop recording."""
        if self.folder is not None:
            self._folder.cleanup()
            self.folder = None

    def __getattr__(self, name: str):
        return getattr(self.session, name)
