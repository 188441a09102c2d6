"""llama.cpp through llama-cpp-python: its own quantizations of a GGUF checkpoint, run by llama.cpp.

For a GGUF source, each requested type (``--llamacpp-types``, default F32, Q8_0, Q4_K_M, Q4_0) is
made from the source file by llama.cpp's own quantizer (``llama_model_quantize``, the library
behind ``llama-quantize``, with its default parameters and ``allow_requantize``: the source may
itself be quantized, and F32 is then its dequantization, the same weights quantnorm's FP32
baseline holds). Each file is loaded twice over the same mapped weights:

- a scoring context with ``logits_all`` (the logits at every position, teacher forcing);
- a decoding context without it (only the last position's logits, as llama.cpp generates when
  deployed), which gives the greedy tokens and the speed.

Token ids go in as they are (no text, no BOS added). A checkpoint that is not a GGUF file, a
llama-cpp-python that is not installed, or a type the quantizer refuses is a ``NotMeasured``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import ConfigError, MeasureError
from ..fileio import atomic_path
from .base import EngineRequest, NotMeasured, Speed, import_failure

NAME = "llamacpp"
# --llamacpp-types name -> llama.cpp's LLAMA_FTYPE_* constant (resolved when llama_cpp is imported).
# The I-quants below IQ4 need an importance matrix, which this tool does not make: not offered.
FTYPES = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q6_K": "MOSTLY_Q6_K",
    "Q5_K_M": "MOSTLY_Q5_K_M", "Q5_K_S": "MOSTLY_Q5_K_S", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
    "Q4_K_M": "MOSTLY_Q4_K_M", "Q4_K_S": "MOSTLY_Q4_K_S", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
    "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS", "Q3_K_L": "MOSTLY_Q3_K_L", "Q3_K_M": "MOSTLY_Q3_K_M",
    "Q3_K_S": "MOSTLY_Q3_K_S", "Q2_K": "MOSTLY_Q2_K",
}
DEFAULT_TYPES = ("F32", "Q8_0", "Q4_K_M", "Q4_0")
INSTALL = "pip install 'quantnorm[llamacpp]' (builds llama.cpp from source, about 10 minutes)"
NOT_INSTALLED = f"not installed: {INSTALL}"
NOT_GGUF = "llama.cpp reads GGUF files: evaluate a .gguf (--model FILE.gguf) to compare with it"
N_BATCH = 512   # llama.cpp's default logical batch: a prompt up to this long is one decode call


def check_types(types) -> tuple[str, ...]:
    """The types, upper-cased and validated (ConfigError naming the choices)."""
    out = tuple(t.strip().upper() for t in types if t.strip())
    unknown = [t for t in out if t not in FTYPES]
    if unknown:
        raise ConfigError(f"--llamacpp-types: unknown llama.cpp type {unknown[0]!r}: choose from {', '.join(FTYPES)}")
    if not out:
        raise ConfigError("--llamacpp-types: give at least one type (e.g. F32,Q8_0,Q4_K_M,Q4_0)")
    return out


def _import():
    import llama_cpp

    return llama_cpp


class LlamaCppEngine:
    name = NAME

    def available(self) -> str | None:
        try:
            _import()
        except ImportError as exc:
            return import_failure(exc, "llama_cpp", INSTALL)
        except (OSError, RuntimeError) as exc:   # the package is there but its shared library does not load
            return f"llama-cpp-python cannot load llama.cpp ({' '.join(str(exc).split())[:200]}): reinstall it"
        return None

    def models(self, request: EngineRequest) -> Iterator[LlamaCppModel | NotMeasured]:
        types = check_types(request.formats or DEFAULT_TYPES)
        why = self.available() or (None if request.checkpoint_kind == "gguf" else NOT_GGUF)
        if why is not None:
            for fmt in types:
                yield NotMeasured(NAME, fmt, why)
            return
        _quiet_logs(_import())
        threads = request.threads or _default_threads()
        source = Path(request.checkpoint)
        for fmt in types:
            path = Path(request.work_dir) / f"{_stem(source)}.{fmt}.gguf"
            why = quantize(source, path, fmt, threads)
            if why is not None:
                yield NotMeasured(NAME, fmt, why)
                continue
            try:
                model = LlamaCppModel(path, fmt, threads=threads, max_length=request.max_length)
            except ConfigError as exc:
                yield NotMeasured(NAME, fmt, str(exc))
                continue
            yield model


def _default_threads() -> int:
    """What ONNX Runtime takes without --threads: one thread per physical core."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _stem(path: Path) -> str:
    name = path.name
    return name[: -len(".gguf")] if name.endswith(".gguf") else path.stem


def _quiet(level: int, text: bytes, user_data) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR (ggml: 1 debug, 2 info, 3 warn, 4 error, 5 continued)
        os.write(2, text)


_QUIET = []   # the ctypes callback, kept alive for as long as llama.cpp may call it


def _quiet_logs(llama_cpp) -> None:
    """llama.cpp logs every tensor it quantizes or loads: only its errors reach stderr."""
    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(_quiet))
    llama_cpp.llama_log_set(_QUIET[0], None)


def quantize(source: Path, out: Path, fmt: str, threads: int) -> str | None:
    """``out``: ``source`` as llama.cpp type ``fmt``, written atomically; None when made, else why not."""
    llama_cpp = _import()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[fmt]}")
    params.allow_requantize = True
    params.nthread = threads
    try:
        with atomic_path(out, suffix=".gguf") as tmp:
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
            if rc != 0:
                raise _Refused(f"llama.cpp's quantizer refused {fmt} for {source.name} (llama_model_quantize "
                               f"returned {rc}; its log says why): choose another --llamacpp-types")
    except _Refused as exc:
        return str(exc)
    return None


class _Refused(Exception):
    """The quantizer failed: the temporary file is removed and the type is not measured."""


class LlamaCppModel:
    """One llama.cpp file, loaded with one context: every position's logits for scoring, only the
    last one's when generating (as llama.cpp generates when deployed)."""

    engine = NAME

    def __init__(self, path: Path, fmt: str, *, threads: int, max_length: int):
        ll = _import()
        _quiet_logs(ll)   # loaded outside the engine's own loop too (benchmarks/vs_llamacpp.py --retime)
        self.format, self.path, self.threads = fmt, Path(path), threads
        self.size_bytes = self.path.stat().st_size
        self.version = ll.__version__
        self.n_ctx = max(int(max_length), 1)
        self.n_batch = max(N_BATCH, self.n_ctx)
        system_info = " ".join(_text(ll.llama_print_system_info()).split())
        extra, why = extra_buffers_work(self.path, amx="AMX_INT8 = 1" in system_info)
        self._ctx = _Context(self.path, n_ctx=self.n_ctx, n_batch=self.n_batch, threads=threads, extra_bufts=extra)
        self.vocab = self._ctx.vocab
        self.settings = {"threads": threads, "n_ctx": self.n_ctx, "n_batch": self.n_batch,
                         "n_ubatch": self._ctx.params.n_ubatch, "ftype": fmt, "ftype_name": _ftype_name(ll, fmt),
                         "quantize": "llama_model_quantize defaults, allow_requantize",
                         "flash_attn": _text(ll.llama_flash_attn_type_name(self._ctx.params.flash_attn_type)),
                         "kv_cache": "f16", "n_gpu_layers": 0, "extra_buffer_types": extra,
                         "system_info": system_info}
        if why is not None:
            self.settings["extra_buffer_types_off"] = why

    def logits(self, windows: np.ndarray) -> np.ndarray:
        windows = np.asarray(windows, dtype=np.int64)
        out = np.empty((*windows.shape, self.vocab), dtype=np.float32)
        for i, window in enumerate(windows):
            self._ctx.reset()
            out[i] = self._ctx.eval(window.tolist(), every_position=True)
        return out

    def _generate(self, prompt: np.ndarray, new_tokens: int) -> tuple[list[int], float, list[float]]:
        """Greedy tokens after ``prompt`` from an empty cache, the prompt's seconds and each step's."""
        ctx = self._ctx
        ctx.reset()
        start = time.perf_counter()
        last = ctx.eval(np.asarray(prompt, dtype=np.int64).tolist(), every_position=False)
        prompt_s = time.perf_counter() - start
        tokens, steps = [int(last.argmax())], []
        for _ in range(new_tokens - 1):   # the first new token comes from the prompt's logits
            start = time.perf_counter()
            last = ctx.eval([tokens[-1]], every_position=False)
            steps.append(time.perf_counter() - start)
            tokens.append(int(last.argmax()))
        return tokens, prompt_s, steps

    def greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        return np.asarray([self._generate(p, new_tokens)[0] for p in np.asarray(prompts)], dtype=np.int64)

    def speed(self, prompt: np.ndarray, new_tokens: int, rounds: int) -> Speed:
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if new_tokens < 2 or rounds < 1:
            raise ConfigError(f"speed needs new_tokens >= 2 and rounds >= 1, got {new_tokens}, {rounds}")
        self._generate(prompt, min(new_tokens, 4))   # warm-up: buffers allocated, pages mapped in
        timed = [self._generate(prompt, new_tokens)[1:] for _ in range(rounds)]
        prompt_s = float(np.median([t[0] for t in timed]))
        steps = np.asarray([t[1] for t in timed], dtype=np.float64)
        gen_s = float(np.median(steps.sum(axis=1)))
        return Speed(prompt_tokens=int(prompt.size), new_tokens=new_tokens, prompt_tok_s=prompt.size / prompt_s,
                     gen_tok_s=steps.shape[1] / gen_s, rounds=rounds,
                     token_ms_p50=round(float(np.percentile(steps, 50)) * 1e3, 4))

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None


class _Context:
    """A model and one context through llama.cpp's C API (llama-cpp-python's ctypes bindings):
    batches built here, so which positions return logits is chosen per call."""

    def __init__(self, path: Path, *, n_ctx: int, n_batch: int, threads: int, extra_bufts: bool):
        ll = self.ll = _import()
        _backend_init(ll)
        model_params = ll.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = extra_bufts
        self.model = ll.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise ConfigError(f"llama.cpp cannot load {path.name} (llama_model_load_from_file failed)")
        self.params = ll.llama_context_default_params()
        self.params.n_ctx, self.params.n_batch = n_ctx, n_batch
        self.params.n_threads = self.params.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, self.params)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise ConfigError(f"llama.cpp cannot make a context of {n_ctx} positions for {path.name}")
        self.vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0

    def reset(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def eval(self, tokens: list[int], *, every_position: bool) -> np.ndarray:
        """Decode ``tokens`` after what the cache holds: logits [n, vocab] (``every_position``)
        or the last position's [vocab]."""
        rows = []
        for lo in range(0, len(tokens), self.n_batch):
            chunk, batch = tokens[lo:lo + self.n_batch], self.batch
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, self.n_past + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = every_position or i == len(chunk) - 1
            rc = self.ll.llama_decode(self.ctx, batch)
            if rc != 0:
                raise MeasureError(f"llama_decode returned {rc} at position {self.n_past} (context {self.params.n_ctx})")
            self.n_past += len(chunk)
            n_out = len(chunk) if every_position else 1
            rows.append(np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(n_out, self.vocab)).copy())
        return np.concatenate(rows) if every_position else rows[-1][0]

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


_BACKEND = []


def _backend_init(ll) -> None:
    if not _BACKEND:
        ll.llama_backend_init()
        _BACKEND.append(True)


# A decode of a few tokens in a child process, with llama.cpp's extra buffer types (the AMX
# kernels, the repacked weights for AVX2/AVX-512): llama.cpp built by GCC 12 for a CPU with AMX
# crashes inside them (SIGSEGV at ldtilecfg: that GCC's _tile_loadconfig tells the compiler it
# reads 8 of the config's 64 bytes, so the stores of the tile shapes are dropped and the
# instruction loads stack garbage; README, Other engines), which would take the whole run with it.
_PROBE = """
import sys, llama_cpp as ll
quiet = ll.llama_log_callback(lambda *a: None)   # kept referenced: llama.cpp calls it later
ll.llama_log_set(quiet, None)
ll.llama_backend_init()
model = ll.llama_model_load_from_file(sys.argv[1].encode(), ll.llama_model_default_params())
params = ll.llama_context_default_params()
params.n_ctx, params.n_threads, params.n_threads_batch = 64, 1, 1
ctx = ll.llama_init_from_model(model, params)
tokens = (ll.llama_token * 8)(*range(8))
sys.exit(ll.llama_decode(ctx, ll.llama_batch_get_one(tokens, 8)))
"""


AMX_HINT = ("llama.cpp built with its AMX kernels by GCC 12 does this: rebuild it with clang "
            "(README, Other engines) to measure it with them")


def extra_buffers_work(path: Path, *, amx: bool = False) -> tuple[bool, str | None]:
    """(whether to use llama.cpp's extra buffer types for ``path``, why not); ``amx``: whether this
    llama.cpp was built with its AMX kernels (its system info lists AMX_INT8)."""
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, timeout=600)
    if done.returncode >= 0:
        return True, None
    try:
        name = signal.Signals(-done.returncode).name
    except ValueError:
        name = f"signal {-done.returncode}"
    why = (f"llama.cpp crashed ({name}) decoding with its extra buffer types (AMX kernels, repacked "
           f"weights) on this machine: the weights stay in plain CPU buffers")
    return False, f"{why}; {AMX_HINT}" if amx else why


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ftype_name(llama_cpp, fmt: str) -> str:
    name = llama_cpp.llama_ftype_name(getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[fmt]}"))
    return _text(name) if name else fmt
