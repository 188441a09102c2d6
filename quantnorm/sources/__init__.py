"""Model sources: adapters that turn a checkpoint into what the one pipeline takes.

``open_model(path, ...)`` chooses the source by what the path holds (the table below, first match
wins); ``quantnorm evaluate --model PATH`` uses it. A zoo run directory is ``ZooSource(RunDir)``.
The members a source has are listed in ``quantnorm.sources.base``.

    a directory with model.onnx            -> onnx_dir.OnnxDirSource   (an exported graph, e.g. Optimum's)
    FILE.gguf or FILE.gguf.part00          -> hf.gguf_source           (dequantized, then a checkpoint)
    a directory (config.json, weights...)  -> hf.HFSource              (a Hugging Face checkpoint)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..data import BUILTIN_PYDOC
from ..errors import ConfigError
from .base import ModelSource, SearchScoring, SourceData
from .gguf import is_gguf_path
from .hf import HFOptions, HFSource, gguf_source
from .onnx_dir import ONNX_FILE, OnnxDirSource, OnnxOptions
from .tokenized import AUTO_EVAL_WINDOWS
from .zoo import ZooSource

__all__ = ["HFOptions", "HFSource", "ModelSource", "OnnxDirSource", "OnnxOptions", "SearchScoring", "SourceData",
           "ZooSource", "open_model"]


def _onnx_dir(path: Path, out, progress, options) -> ModelSource:
    return OnnxDirSource(OnnxOptions(path=path, out_dir=out, **options))


def _gguf(path: Path, out, progress, options) -> ModelSource:
    return gguf_source(path, out=out, progress=progress, **options)


def _hf_dir(path: Path, out, progress, options) -> ModelSource:
    return HFSource(HFOptions(path=path, out_dir=out, **options))


# (what the path holds, the source made from it): the dispatch is this table and open_model's loop.
SOURCES: list[tuple[Callable[[Path], bool], Callable[..., ModelSource]]] = [
    (lambda p: p.is_dir() and (p / ONNX_FILE).is_file(), _onnx_dir),
    (is_gguf_path, _gguf),
    (lambda p: True, _hf_dir),  # a checkpoint directory; HFSource says what is missing when it is not one
]


def open_model(path: Path, *, window: int = 128, corpus: str | None = None, eval_tokens: int | None = None,
               out: Path | None = None, allow_pickle: bool = False, progress: bool = True) -> ModelSource:
    """The source for ``--model PATH``. ``eval_tokens``: the evaluation budget in tokens (whole
    windows of ``window`` tokens; default: ``hf.data.default_eval_windows``, 128 windows, 64 for a
    262k vocabulary)."""
    path = Path(path)
    if not path.exists() and not is_gguf_path(path):
        raise ConfigError(f"--model {path}: no such file or directory (give a Hugging Face checkpoint directory, "
                          f"an ONNX export directory with model.onnx, or a .gguf file)")
    max_eval_windows = AUTO_EVAL_WINDOWS if eval_tokens is None else max(2, int(eval_tokens) // window)
    options = {"corpus": corpus or BUILTIN_PYDOC, "window": window, "max_eval_windows": max_eval_windows}
    if allow_pickle:
        options["allow_pickle"] = True
    for holds, make in SOURCES:
        if holds(path):
            return make(path, out, progress, options)
    raise AssertionError("unreachable: the last entry of SOURCES matches every path")
