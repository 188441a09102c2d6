"""What another inference engine hands the pipeline: a model it runs, as the pipeline scores it.

An engine (llama.cpp, ONNX Runtime GenAI) is what a user would deploy instead of quantnorm's own
INT8 models. It is measured on the same checkpoint, the same token ids and the same threads as
quantnorm's own rows, and scored against the same FP32 baseline by quantnorm's own metrics: so an
engine only has to make its models and run them. The scoring (``engine_stage``) is written once.

- ``Engine.models(request)`` yields one ``EngineModel`` per format it makes from the checkpoint
  (llama.cpp: F32, Q8_0, Q4_K_M, ...; ONNX Runtime GenAI: its model builder's INT4), or a
  ``NotMeasured`` for a format it cannot make here, with the reason;
- an ``EngineModel`` gives teacher-forced logits for token windows, greedy tokens from prompts, and
  its own speed (a prompt processed at once, then one token at a time against its KV cache).

Token ids are the checkpoint's own vocabulary (quantnorm's windows, fed as ids: no text, no
tokenizer round trip, no BOS added by the engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class EngineRequest:
    """What the run gives every engine."""

    checkpoint: Path        # the file or directory the source read (a GGUF file, a Hugging Face directory)
    checkpoint_kind: str    # "gguf" | "hf"
    hf_dir: Path | None     # a Hugging Face directory of the same weights (the checkpoint itself, or
                            # the GGUF's dequantization the source made), for engines that build from one
    work_dir: Path          # where the engine writes its models (<run dir>/engines/<engine>)
    threads: int            # the threads quantnorm's own rows ran with
    max_length: int         # the longest sequence (prompt + new tokens) the engine must hold
    formats: tuple[str, ...] = ()   # which formats to make (empty: the engine's defaults)
    progress: bool = True


@dataclass(frozen=True)
class NotMeasured:
    """A format the engine could not make or run here, and why (one line a user can act on)."""

    engine: str
    format: str
    reason: str


@dataclass(frozen=True)
class Speed:
    """One prompt of ``prompt_tokens`` processed at once, then ``new_tokens`` greedy tokens one at a
    time, batch 1, median over rounds after a warm-up."""

    prompt_tokens: int
    new_tokens: int
    prompt_tok_s: float
    gen_tok_s: float
    rounds: int
    token_ms_p50: float | None = None

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prompt_tok_s": round(self.prompt_tok_s, 2), "gen_tok_s": round(self.gen_tok_s, 2),
                "rounds": self.rounds, "token_ms_p50": self.token_ms_p50}


class EngineModel(Protocol):
    """One format of one engine, loaded and ready to run."""

    engine: str           # "llamacpp" | "ortgenai"
    format: str           # "Q8_0", "int4-rtn-b32-acc4", ...
    path: Path            # the model file or folder it runs
    size_bytes: int       # what a user would ship (the file, or the folder's files)
    version: str          # the engine's version
    settings: dict        # everything that decides its numbers (threads, quantization settings, ...)

    def logits(self, windows: np.ndarray) -> np.ndarray:
        """[n, seq] int64 token ids -> [n, seq, vocab] float32: each window from an empty cache,
        the logits at every position (teacher forcing)."""

    def greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        """[n, prompt] int64 -> [n, new_tokens] int64: greedy (argmax) tokens, no stop token."""

    def speed(self, prompt: np.ndarray, new_tokens: int, rounds: int) -> Speed:
        """``prompt``: [prompt_tokens] int64, batch 1."""

    def close(self) -> None:
        """Let the model's memory go."""


def import_failure(exc: ImportError, module: str, install: str) -> str:
    """Why an engine's package did not import: ``not installed: INSTALL`` where ``module`` itself is
    missing; where the package is there but one of its own imports fails (a dependency left out by
    a ``--no-deps`` or ``--target`` install), that module named, so the row does not send the user
    to install what they have."""
    missing = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and missing and missing.split(".")[0] != module:
        return f"{module} is installed but does not import (its dependency {missing} is missing): {install}"
    return f"not installed: {install}"


class Engine(Protocol):
    name: str

    def available(self) -> str | None:
        """None when the engine can run here, else why not ("not installed: pip install ...")."""

    def models(self, request: EngineRequest) -> Iterator[EngineModel | NotMeasured]:
        """One at a time: the caller scores and closes each before the next is made."""


@dataclass
class EngineRows:
    """The rows of one engine in ``results["engines"]``."""

    engine: str
    version: str | None = None
    rows: list[dict] = field(default_factory=list)
