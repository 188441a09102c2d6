"""The engine stage of ``evaluate`` (``--engines``): what a user would deploy instead, measured
beside quantnorm's own rows on the same checkpoint, tokens and threads.

Each engine (``quantnorm.engines``) makes its own models of the checkpoint (llama.cpp: its
quantizations of a GGUF file), one at a time; each is scored here, the same way for every engine,
then closed before the next is made:

- accuracy: against the run's FP32 ONNX model on the run's evaluation windows, the same scored
  positions and targets as every recipe (``PairLadder``: PPL ratio, KL, top-1), a few windows at
  a time so a large vocabulary's logits stay bounded;
- generation agreement: greedy tokens from the generation stage's prompts against FP32's greedy
  continuation on its with-past graph (``generation.agreement``, the statistics every recipe
  gets); None with ``--no-generation`` (no with-past graph to continue from);
- speed: a prompt of the generation stage's length processed at once, then its number of new
  tokens one at a time, batch 1, the run's threads.

The section it returns is ``results["engines"]`` (read back by ``results.engine_rows``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .engines import EngineRequest, NotMeasured, get_engine
from .errors import MeasureError, QuantnormError
from .fileio import release_memory
from .generation.agreement import agreement_prompts, engine_agreement, fp32_continuation
from .generation.speed import decode_lengths
from .generation_stage import speed_prompts
from .measure.accuracy import PairLadder, run_logits
from .measure.sessions import SessionSpec, make_session
from .measure.token_metrics import auto_batch, logits_vocab, token_summary
from .results import BROKEN_PREFIX, MEASURED, NOT_MEASURED_PREFIX, OK
from .runs import past_onnx_file
from .sources import HFSource, OnnxDirSource

NO_GENERATION = ("not measured: generation agreement continues FP32's with-past graph, which --no-generation "
                 "does not export")


def engines_section(source, cfg, *, run_dir: Path, fp32_path: Path, generation: dict | None,
                    stage: Callable) -> dict:
    """``results["engines"]``: one entry per engine of ``cfg.engines``, a row per format it makes.
    ``generation``: the run's ``results["generation"]`` (None without the generation stage)."""
    scoring = source.scoring(cfg)
    if scoring.level != "token":
        return {"status": f"{NOT_MEASURED_PREFIX}other engines are compared on next-token predictions, and this "
                          f"model is scored by {scoring.level}"}
    measured = generation is not None and generation.get("status") == MEASURED
    max_length = (generation["settings"]["max_length"] if measured else None) or getattr(source, "max_positions", None)
    prompt_tokens, new_tokens = decode_lengths(max_length, cfg.gen_prompt_tokens, cfg.gen_new_tokens)
    eval_inputs = np.asarray(source.data.eval_inputs)[:, :max_length]   # as the generation stage cuts them
    reference = None
    if measured:
        with stage("engines:fp32_continuation"):
            prompts, agreement_new = agreement_prompts(eval_inputs, max_length,
                                                       n=cfg.agreement_prompts, new_tokens=cfg.agreement_new_tokens)
            reference = fp32_continuation(run_dir / past_onnx_file("fp32"), prompts, agreement_new,
                                          threads=cfg.threads)
    longest = max(scoring.inputs.shape[1], prompt_tokens + new_tokens,
                  reference.prompts.shape[1] + reference.tokens.shape[1] if reference is not None else 0)
    spec = SessionSpec(graph_optimization_level=cfg.graph_optimization_level, threads=cfg.threads)
    fp32 = make_session(fp32_path, spec)
    speed_prompt = speed_prompts(eval_inputs, prompt_tokens, 1)[0]
    groups = []
    for name in cfg.engines:
        request = engine_request(source, run_dir, name, threads=cfg.threads, max_length=longest,
                                 formats=cfg.engine_formats(name), progress=cfg.progress)
        measure = _Measure(fp32, scoring, reference, speed_prompt, new_tokens, cfg, run_dir)
        with stage(f"engines:{name}"):
            groups.append(_engine_rows(name, request, measure, stage))
    return {"status": OK, "engines": groups}


def engine_request(source, run_dir: Path, name: str, *, threads: int | None, max_length: int,
                   formats: tuple[str, ...], progress: bool) -> EngineRequest:
    """What the run hands an engine: the checkpoint as the source read it, and what kind it is."""
    if isinstance(source, HFSource):
        gguf = source.opts.gguf
        kind, checkpoint = ("gguf", gguf) if gguf is not None else ("hf", source.opts.path)
        hf_dir = source.opts.path
    elif isinstance(source, OnnxDirSource):
        kind, checkpoint, hf_dir = "onnx", source.opts.path, None
    else:
        kind, checkpoint, hf_dir = "zoo", Path(run_dir), None
    return EngineRequest(checkpoint=Path(checkpoint), checkpoint_kind=kind, hf_dir=hf_dir,
                         work_dir=Path(run_dir) / "engines" / name, threads=threads, max_length=max_length,
                         formats=tuple(formats), progress=progress)


def _engine_rows(name: str, request: EngineRequest, measure: _Measure, stage: Callable) -> dict:
    """One engine's entry: its version and a row per format, each model closed before the next is made."""
    group: dict = {"engine": name, "version": None, "rows": []}
    models = get_engine(name).models(request)
    bar = tqdm(desc=f"engine {name}", unit="format", total=len(request.formats) or None,
               disable=not request.progress, leave=False)
    while True:
        started = time.perf_counter()
        model = next(models, None)
        if model is None:
            break
        bar.update(1)
        if isinstance(model, NotMeasured):
            group["rows"].append({"format": model.format, "status": NOT_MEASURED_PREFIX + model.reason})
            continue
        made_s = round(time.perf_counter() - started, 2)
        group["version"] = model.version
        try:
            with stage(f"engines:{name}:{model.format}"):
                group["rows"].append({**measure(model), "seconds_to_make": made_s})
        finally:
            model.close()
            release_memory()
    bar.close()
    return group


class _Measure:
    """A row of one engine model: accuracy, agreement and speed, as the module doc says."""

    def __init__(self, fp32, scoring, reference, speed_prompt: np.ndarray, new_tokens: int, cfg, run_dir: Path):
        self.fp32, self.scoring, self.reference = fp32, scoring, reference
        self.speed_prompt, self.new_tokens, self.cfg, self.run_dir = speed_prompt, new_tokens, cfg, Path(run_dir)

    def __call__(self, model) -> dict:
        path = Path(model.path)
        row = {"format": model.format, "status": OK,
               "path": path.relative_to(self.run_dir).as_posix() if path.is_relative_to(self.run_dir) else path.name,
               "size_bytes": int(model.size_bytes), "settings": model.settings}
        try:
            row["accuracy"] = self.accuracy(model)
            row["agreement"] = (engine_agreement(model.greedy, model.logits, logits_vocab(self.fp32), self.reference)
                                if self.reference is not None else None)
            if self.reference is None:
                row["agreement_status"] = NO_GENERATION
            row["speed"] = model.speed(self.speed_prompt, self.new_tokens, self.cfg.gen_rounds).to_dict()
        except QuantnormError as exc:
            return {**row, "status": BROKEN_PREFIX + " ".join(str(exc).split())[:300]}
        return row

    def accuracy(self, model) -> dict:
        """The run's token accuracy of ``model`` against FP32, a few windows at a time."""
        inputs, targets = np.asarray(self.scoring.inputs), np.asarray(self.scoring.targets)
        step = auto_batch(inputs.shape[1], logits_vocab(self.fp32))
        ladder = PairLadder()
        for lo in tqdm(range(0, len(inputs), step), desc=f"{model.engine} {model.format} accuracy", unit="chunk",
                       disable=not self.cfg.progress, leave=False):
            chunk = inputs[lo:lo + step]
            lp = next(run_logits(self.fp32, chunk, len(chunk)))
            lq = model.logits(chunk)
            if lq.shape != lp.shape:
                raise MeasureError(f"{model.engine} {model.format} gives logits {list(lq.shape)}, the FP32 model "
                                   f"{list(lp.shape)} (a different vocabulary?)")
            if not np.isfinite(lq).all():
                raise MeasureError(f"{model.engine} {model.format} gives NaN or inf logits")
            ladder.add(lp, lq, targets[lo:lo + step])
        return token_summary(ladder)
