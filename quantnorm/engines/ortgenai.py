"""ONNX Runtime GenAI: its model builder's model of the checkpoint, run through its own generator.

What a user of ONNX Runtime GenAI ships for a CPU: ``python -m onnxruntime_genai.models.builder
-p int4 -e cpu`` on the Hugging Face directory, with the builder's own defaults (weight-only
``MatMulNBits``, its block size, ``accuracy_level`` 4 on the CPU: activations quantized to int8 per
block). Nothing is tuned here; the settings record the builder's command, its version, and the
quantization attributes read back from the graph it wrote, so the row says what ran.

The builder runs in a subprocess (it loads the whole checkpoint in torch: its memory goes back to
the OS when it exits) and writes into a temporary folder beside the target, renamed into place
when it succeeds. The model then runs in ONNX Runtime GenAI's ``Generator``:

- ``logits``: each window appended at once to a fresh generator; the ``logits`` output holds every
  position (teacher forcing);
- ``greedy``: the argmax of the last position, appended one token at a time (the generator's KV
  cache). Not ``generate_next_token``: asked not to stop (``min_length``), its search masks the end
  of sequence token, which changes greedy tokens where the model's argmax is that token;
- ``speed``: the prompt appended at once, then ``generate_next_token`` one token per step (what a
  user's loop runs), batch 1, the median over rounds after a warm-up. ``generate_next_token`` picks a
  token from the logits it holds and runs the model on it at the next call, so the first call runs
  no model: the timed steps are the calls after it, one forward pass of one token each.

Threads: the decoder's ``intra_op_num_threads`` set to the run's (``og.Config.overlay``; the folder
keeps the builder's genai_config.json as it wrote it); a run without ``--threads`` leaves ONNX
Runtime's default, as quantnorm's own rows have it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .base import EngineRequest, NotMeasured, Speed, import_failure

NAME = "ortgenai"
INSTALL = "pip install --no-deps onnxruntime-genai==0.18.0"
BUILDER = "onnxruntime_genai.models.builder"
# The builder's precisions that its CPU execution provider runs (fp16 and bf16 target GPUs).
PRECISIONS = ("int4", "int8", "fp32")
DEFAULT_FORMATS = ("int4",)
_ERROR_LINE = re.compile(r"^\w*(Error|Exception)\b.*")


def _genai():
    import onnxruntime_genai as og  # the ortgenai extra, imported only when the engine runs

    return og


class OrtGenAIEngine:
    name = NAME

    def available(self) -> str | None:
        try:
            _genai()
        except ImportError as exc:
            return import_failure(exc, "onnxruntime_genai", INSTALL)
        except OSError as exc:   # the native library did not load
            return f"onnxruntime-genai does not load here ({str(exc).splitlines()[0]}): reinstall it with {INSTALL}"
        return None

    def models(self, request: EngineRequest) -> Iterator[OrtGenAIModel | NotMeasured]:
        formats = request.formats or DEFAULT_FORMATS
        why = self.available()
        if why is None and request.hf_dir is None:
            why = ("ONNX Runtime GenAI's model builder reads a Hugging Face directory, and this source "
                   "gives none: pass --model a Hugging Face directory or a GGUF file")
        for precision in formats:
            if why is not None:
                yield NotMeasured(NAME, precision, why)
            elif precision not in PRECISIONS:
                yield NotMeasured(NAME, precision, f"unknown ONNX Runtime GenAI format {precision!r}: choose from "
                                                   f"{', '.join(PRECISIONS)}")
            else:
                built = build_model(Path(request.hf_dir), Path(request.work_dir), precision,
                                    threads=request.threads, progress=request.progress)
                yield built if isinstance(built, NotMeasured) else OrtGenAIModel(*built, threads=request.threads)


# --- the model builder ---------------------------------------------------------------------------

def builder_args(precision: str) -> list[str]:
    """The builder's options besides its input, output and cache folders: its defaults otherwise."""
    return ["--precision", precision, "--execution_provider", "cpu"]


def build_model(hf_dir: Path, work_dir: Path, precision: str, *, threads: int | None,
                progress: bool = False) -> tuple[Path, dict] | NotMeasured:
    """(model folder ``work_dir/<precision>``, settings), or why the builder refused the checkpoint."""
    target = work_dir / precision
    work_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / f"{precision}.builder.log"
    tmp = Path(tempfile.mkdtemp(prefix=f".{precision}.{os.getpid()}-", suffix=".tmp", dir=work_dir))
    try:
        command = [sys.executable, "-m", BUILDER, "--input", str(hf_dir), "--output", str(tmp / "model"),
                   "--cache_dir", str(tmp / "cache"), *builder_args(precision)]
        # the builder's torch and numpy within the run's threads; nothing fetched from a hub
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})}
        if progress:
            print(f"{NAME}: building {precision} from {hf_dir} with ONNX Runtime GenAI's model builder",
                  file=sys.stderr, flush=True)
        with open(tmp / "builder.log", "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
        shutil.move(str(tmp / "builder.log"), log)
        if done.returncode != 0 or not (tmp / "model" / "genai_config.json").is_file():
            return NotMeasured(NAME, precision, f"ONNX Runtime GenAI's model builder refused {hf_dir.name}: "
                                                f"{_error_line(log, done.returncode)} (log: {log})")
        _replace_dir(tmp / "model", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, {"builder": BUILDER, "builder_version": _genai().__version__,
                    "builder_options": builder_args(precision), "precision": precision,
                    "execution_provider": "cpu", **graph_quantization(target)}


def _error_line(log: Path, returncode: int) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or [f"no output, exit status {returncode}"])[-1][:300]


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` onto ``target``; an earlier build there is moved aside first, then removed."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.{os.getpid()}-old.tmp")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def graph_quantization(folder: Path) -> dict:
    """The weight-only quantization the builder chose, read from its graph: each distinct
    (bits, block_size, accuracy_level) of its ``MatMulNBits`` nodes and how many nodes have it."""
    import onnx

    config = json.loads((folder / "genai_config.json").read_text())
    graph = onnx.load(folder / config["model"]["decoder"]["filename"], load_external_data=False).graph
    kinds: dict[tuple, int] = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            key = (attrs.get("bits"), attrs.get("block_size"), attrs.get("accuracy_level", 0))
            kinds[key] = kinds.get(key, 0) + 1
    return {"matmulnbits": [{"bits": b, "block_size": s, "accuracy_level": a, "nodes": n}
                            for (b, s, a), n in sorted(kinds.items())],
            "io_dtype": _io_dtype(graph)}


def _io_dtype(graph) -> str:
    import onnx

    logits = [o for o in graph.output if o.name == "logits"]
    return onnx.helper.tensor_dtype_to_np_dtype(logits[0].type.tensor_type.elem_type).name if logits else "unknown"


def format_name(precision: str, settings: dict) -> str:
    """``int4-b32-acc4``: the precision with the block size and accuracy level the graph holds."""
    kinds = settings.get("matmulnbits") or []
    if len(kinds) != 1:
        return precision if not kinds else f"{precision}-mixed"
    return f"{precision}-b{kinds[0]['block_size']}-acc{kinds[0]['accuracy_level']}"


# --- the model, run through ONNX Runtime GenAI's generator ----------------------------------------

class OrtGenAIModel:
    engine = NAME

    def __init__(self, path: Path, settings: dict, *, threads: int | None):
        og = _genai()
        self.path = Path(path)
        self.version = og.__version__
        self.format = format_name(settings["precision"], settings)
        # threads None: ONNX Runtime's default (one per physical core), as quantnorm's own rows ran
        session = {"intra_op_num_threads": int(threads)} if threads else {}
        self.settings = {**settings, "threads": int(threads) if threads else None, "session_options": session}
        self.size_bytes = sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        config = og.Config(str(self.path))
        if session:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": session}}}))
        self._og, self._model = og, og.Model(config)

    def _generator(self, max_length: int, min_length: int = 0):
        params = self._og.GeneratorParams(self._model)
        params.set_search_options(do_sample=False, max_length=max_length, min_length=min_length)
        return self._og.Generator(self._model, params)

    def logits(self, windows: np.ndarray) -> np.ndarray:
        windows = np.asarray(windows, dtype=np.int32)
        out = None
        for i, window in enumerate(windows):
            generator = self._generator(window.shape[0])
            generator.append_tokens(window[None])
            row = np.asarray(generator.get_output("logits"), dtype=np.float32)[0]
            if out is None:
                out = np.empty((*windows.shape, row.shape[-1]), dtype=np.float32)
            out[i] = row
            del generator
        return out if out is not None else np.zeros((*windows.shape, 0), dtype=np.float32)

    def greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        prompts = np.asarray(prompts, dtype=np.int32)
        out = np.empty((prompts.shape[0], new_tokens), dtype=np.int64)
        for i, prompt in enumerate(prompts):
            generator = self._generator(prompt.shape[0] + new_tokens)
            generator.append_tokens(prompt[None])
            for step in range(new_tokens):
                out[i, step] = int(np.asarray(generator.get_logits())[0, -1].argmax())
                if step + 1 < new_tokens:
                    generator.append_tokens(out[i, step:step + 1].astype(np.int32)[None])
            del generator
        return out

    def _one_generation(self, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
        total = prompt.shape[0] + new_tokens
        generator = self._generator(total, min_length=total)   # no stop before new_tokens
        start = time.perf_counter()
        generator.append_tokens(prompt[None])
        prompt_s = time.perf_counter() - start
        generator.generate_next_token()   # picks the first token from the prompt's logits: no model run
        steps = []
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - start)
        return prompt_s, steps

    def speed(self, prompt: np.ndarray, new_tokens: int, rounds: int) -> Speed:
        prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
        new_tokens, rounds = max(int(new_tokens), 2), max(int(rounds), 1)
        self._one_generation(prompt, min(new_tokens, 4))   # warm-up: allocations, kernels chosen
        timed = [self._one_generation(prompt, new_tokens) for _ in range(rounds)]
        prompt_s = float(np.median([t[0] for t in timed]))
        steps = np.asarray([t[1] for t in timed], dtype=np.float64)
        gen_s = float(np.median(steps.sum(axis=1)))
        return Speed(prompt_tokens=int(prompt.shape[0]), new_tokens=new_tokens,
                     prompt_tok_s=prompt.shape[0] / prompt_s, gen_tok_s=steps.shape[1] / gen_s, rounds=rounds,
                     token_ms_p50=round(float(np.percentile(steps, 50)) * 1e3, 4))

    def close(self) -> None:
        self._model = None
        import gc

        gc.collect()
