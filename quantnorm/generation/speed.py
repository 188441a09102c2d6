"""Decode speed of a with-past graph, as users measure it: the prompt and the new tokens apart.

One measurement (``decode_speed``) prefills a prompt of ``prompt_tokens`` tokens at ``batch``
rows (one step after an empty cache), then generates ``new_tokens`` greedy tokens one step at a
time with the cache kept in ONNX Runtime between steps (``DecodeSession``: I/O binding), so what
is timed is the model, not copies of the cache. It is repeated ``rounds`` times after one
warm-up generation; the row keeps the median over rounds:

- ``prompt_tokens_per_s``: batch x prompt tokens / the prefill's wall time;
- ``gen_tokens_per_s``: batch x timed steps / their summed wall time (llama-bench's "tg");
- ``token_ms_p50`` / ``token_ms_p90``: percentiles of the per-step times (every step of every round);
- ``per_position_ms``: the median time of the step at each position (the plot's line: the cache
  grows, so later steps read more keys);
- ``peak_rss_mb``: the process's resident memory at its peak while the session was open and
  decoding, sampled every few milliseconds: the weights, ORT's arenas and the cache at its
  longest (``rss_increase_mb``: that peak less the resident memory before the session opened).

An unusable provider gives ``status: "not measured: <why>"`` and no figures.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import psutil

from ..errors import ConfigError
from ..measure.sessions import ProviderUnavailable, SessionSpec, provider_status
from .decode import DecodeSession

NOT_MEASURED = "not measured: "
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_NEW_TOKENS = 128
DEFAULT_BATCHES = (1, 4)
DEFAULT_ROUNDS = 2
_RSS_SAMPLE_S = 0.005


class _PeakRss:
    """The process's peak resident memory while the ``with`` block runs (a sampling thread)."""

    def __init__(self):
        self.process = psutil.Process()
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(_RSS_SAMPLE_S):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def decode_lengths(max_length: int | None, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                   new_tokens: int = DEFAULT_NEW_TOKENS) -> tuple[int, int]:
    """(prompt, new) within a model's ``max_length`` positions: as asked when they fit, else each
    cut to half the positions (a 128-position zoo model: 64 + 64). The row records what ran."""
    if max_length is None or prompt_tokens + new_tokens <= max_length:
        return prompt_tokens, new_tokens
    half = max_length // 2
    return min(prompt_tokens, max_length - min(new_tokens, half)), min(new_tokens, half)


def _one_generation(runner: DecodeSession, prompts: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
    runner.reset(len(prompts))
    start = time.perf_counter()
    logits = runner.step(prompts)
    prompt_s = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):   # the first new token comes from the prompt's logits
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        start = time.perf_counter()
        logits = runner.step(token)
        steps.append(time.perf_counter() - start)
    return prompt_s, steps


def decode_speed(path: str | Path, prompts: np.ndarray, *, new_tokens: int, spec: SessionSpec,
                 rounds: int = DEFAULT_ROUNDS) -> dict:
    """One row (see the module doc) for the with-past graph at ``path``, prompts [batch, prompt]."""
    prompts = np.ascontiguousarray(prompts, dtype=np.int64)
    if prompts.ndim != 2 or new_tokens < 2 or rounds < 1:
        raise ConfigError(f"decode speed needs prompts [batch, prompt], new_tokens >= 2 and rounds >= 1, got "
                          f"{list(prompts.shape)}, {new_tokens}, {rounds}")
    batch, prompt = prompts.shape
    row = {"provider": spec.provider, "batch": batch, "prompt_tokens": prompt,
           "new_tokens": new_tokens, "threads": spec.threads}
    why = provider_status(spec.provider)
    if why is not None:
        return {**row, "status": NOT_MEASURED + why}
    with _PeakRss() as memory:
        try:
            runner = DecodeSession(path, spec=spec)
        except ProviderUnavailable as exc:
            return {**row, "status": NOT_MEASURED + str(exc)}
        _one_generation(runner, prompts, min(new_tokens, 4))   # warm-up: allocations, kernels chosen
        timed = [_one_generation(runner, prompts, new_tokens) for _ in range(rounds)]
        del runner
    prompt_s = float(np.median([t[0] for t in timed]))
    steps = np.asarray([t[1] for t in timed], dtype=np.float64)      # [rounds, new_tokens - 1]
    gen_s = float(np.median(steps.sum(axis=1)))
    return {**row, "status": "measured", "rounds": rounds,
            "prompt_s": round(prompt_s, 6), "prompt_tokens_per_s": round(batch * prompt / prompt_s, 2),
            "gen_tokens_per_s": round(batch * steps.shape[1] / gen_s, 2),
            "token_ms_p50": round(float(np.percentile(steps, 50)) * 1e3, 4),
            "token_ms_p90": round(float(np.percentile(steps, 90)) * 1e3, 4),
            "per_position_ms": [round(float(v) * 1e3, 4) for v in np.median(steps, axis=0)],
            "peak_rss_mb": round(memory.peak / 2**20, 1),
            "rss_increase_mb": round((memory.peak - memory.before) / 2**20, 1)}
