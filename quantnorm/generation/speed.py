"""Decode speed of a with-past graph, as users measure it: the prompt and the new tokens apart.

One measurement (``decode_speed``) prefills a prompt of ``prompt_tokens`` tokens at ``batch``
rows (one step after an empty cache), then generates ``new_tokens`` greedy tokens one step at a
time with the cache kept in ONNX Runtime between steps (``DecodeSession``: I/O binding), so what
is timed is the model, not copies of the cache. It is repeated ``rounds`` times after one
warm-up generation; the row keeps the median over rounds:

- ``prompt_tokens_per_s``: batch x prompt tokens / the prefill's wall time (the prefill computes
  the last position's logits only, where the graph takes ``logits_to_keep``, as llama.cpp does);
- ``gen_tokens_per_s``: batch x timed steps / their summed wall time (llama-bench's "tg");
- ``token_ms_p50`` / ``token_ms_p90``: percentiles of the per-step times (every step of every round);
- ``per_position_ms``: the median time of the step at each position (the plot's line: the cache
  grows, so later steps read more keys);
- ``cache``: ``"shared buffer"`` where the graph's attention appends to one buffer in place
  (``DecodeSession``), ``"present per step"`` where each step writes a fresh present;
- ``peak_rss_mb``: the process's resident memory at its peak while the session was open and
  decoding, sampled every few milliseconds: the weights, ORT's arenas and the cache at its
  longest (``rss_increase_mb``: that peak less the resident memory before the session opened);
- ``step_profile`` (``profile_steps`` > 0): where a one-token step's time goes, from a separate
  session under ORT's profiler (not a timed run): kernel milliseconds per op type per step, nodes
  per step, and ``weight_bytes``, what a step reads whole (``weights_read_per_step``). That
  times the generation tokens/s is the rate the step streams its weights at; near the machine's
  memory bandwidth, only fewer bytes make a step faster.

An unusable provider gives ``status: "not measured: <why>"`` and no figures.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

from ..errors import ConfigError
from ..measure.latency import kernel_events_in, kernel_us_by_op, profile_runs, read_profile
from ..measure.sessions import ProviderUnavailable, SessionSpec, provider_status
from ..onnx_wire import initializer_places, onnx_nodes
from ..providers import short_provider
from .decode import DecodeSession

NOT_MEASURED = "not measured: "
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_NEW_TOKENS = 128
DEFAULT_BATCHES = (1, 4)
DEFAULT_ROUNDS = 2
CACHE_SHARED, CACHE_PER_STEP = "shared buffer", "present per step"
_RSS_SAMPLE_S = 0.005
PROFILED_STEPS = 32
# Initializers a one-token step reads a row of, not whole: a token table (the data and scales of a
# Gather) and the rotary caches of GroupQueryAttention (its inputs 7 and 8).
_ROW_READS = {"Gather": (0, 2), "GatherBlockQuantized": (0, 2), "GroupQueryAttention": (7, 8)}


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
    runner.reset(len(prompts), prompts.shape[1] + new_tokens)
    start = time.perf_counter()
    logits = runner.step(prompts, last_only=True)   # the next token's logits only, as llama.cpp's prompt
    prompt_s = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):   # the first new token comes from the prompt's logits
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        start = time.perf_counter()
        logits = runner.step(token)
        steps.append(time.perf_counter() - start)
    return prompt_s, steps


def decode_speed(path: str | Path, prompts: np.ndarray, *, new_tokens: int, spec: SessionSpec,
                 rounds: int = DEFAULT_ROUNDS, shared_cache: bool | None = None,
                 prompt_path: str | Path | None = None, profile_steps: int = 0) -> dict:
    """One row (see the module doc) for the with-past graph at ``path``, prompts [batch, prompt];
    ``shared_cache`` as ``DecodeSession`` takes it (None: one buffer where the graph allows);
    ``prompt_path``: a split deployment's prompt graph (the prefill runs there, both held open);
    ``profile_steps``: that many one-token steps profiled after the timing (``step_profile``)."""
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
            runner = DecodeSession(path, spec=spec, shared_cache=shared_cache, prompt_model=prompt_path)
        except ProviderUnavailable as exc:
            return {**row, "status": NOT_MEASURED + str(exc)}
        _one_generation(runner, prompts, min(new_tokens, 4))   # warm-up: allocations, kernels chosen
        timed = [_one_generation(runner, prompts, new_tokens) for _ in range(rounds)]
        cache = CACHE_SHARED if runner.shared else CACHE_PER_STEP
        del runner
    prompt_s = float(np.median([t[0] for t in timed]))
    steps = np.asarray([t[1] for t in timed], dtype=np.float64)      # [rounds, new_tokens - 1]
    gen_s = float(np.median(steps.sum(axis=1)))
    if profile_steps > 0:
        row["step_profile"] = step_profile(path, prompts, steps=min(profile_steps, new_tokens - 1), spec=spec,
                                           shared_cache=shared_cache, prompt_path=prompt_path)
    return {**row, "status": "measured", "rounds": rounds, "cache": cache,
            "prompt_s": round(prompt_s, 6), "prompt_tokens_per_s": round(batch * prompt / prompt_s, 2),
            "gen_tokens_per_s": round(batch * steps.shape[1] / gen_s, 2),
            "token_ms_p50": round(float(np.percentile(steps, 50)) * 1e3, 4),
            "token_ms_p90": round(float(np.percentile(steps, 90)) * 1e3, 4),
            "per_position_ms": [round(float(v) * 1e3, 4) for v in np.median(steps, axis=0)],
            "peak_rss_mb": round(memory.peak / 2**20, 1),
            "rss_increase_mb": round((memory.peak - memory.before) / 2**20, 1)}


def step_profile(path: str | Path, prompts: np.ndarray, *, steps: int, spec: SessionSpec,
                 shared_cache: bool | None = None, prompt_path: str | Path | None = None) -> dict:
    """Where a one-token step of the graph at ``path`` spends its time: ``steps`` steps after the
    prompt, in a session of their own under ORT's profiler (after a short warm-up generation),
    averaged per step. ``op_ms``: kernel milliseconds per op type (largest first); ``kernel_ms``
    their sum; ``run_ms``: ORT's whole run per step (kernels, the executor between them, and the
    profiler's own cost); ``nodes``: kernels run per step; ``weight_bytes``: what a step reads whole
    (``weights_read_per_step``). Profiled times run a little over timed ones."""
    if steps < 1:
        raise ConfigError(f"a step profile needs steps >= 1, got {steps}")
    with tempfile.TemporaryDirectory(prefix="quantnorm-step-profile-") as tmp:
        runner = DecodeSession(path, spec=spec, shared_cache=shared_cache, prompt_model=prompt_path,
                               profile_prefix=Path(tmp) / "ort")
        _one_generation(runner, prompts, min(steps, 4))   # warm-up, as the timed rounds have
        _one_generation(runner, prompts, steps + 1)       # the prompt, then `steps` one-token steps
        events = read_profile(Path(runner.session.end_profiling()))
        del runner
    runs = profile_runs(events)[-steps:]   # the last runs of the token graph: the one-token steps
    kernels = kernel_events_in(events, runs)
    op_us: Counter = Counter()
    for by_op in kernel_us_by_op(kernels).values():
        op_us.update(by_op)
    n = len(runs)
    return {"steps": n, "batch": len(prompts), "provider": spec.provider, "threads": spec.threads,
            "run_ms": round(sum(r.get("dur", 0) for r in runs) / n / 1e3, 4),
            "kernel_ms": round(sum(op_us.values()) / n / 1e3, 4),
            "op_ms": {op: round(us / n / 1e3, 4) for op, us in op_us.most_common()},
            "nodes": round(len(kernels) / n), "weight_bytes": weights_read_per_step(path)}


def weights_read_per_step(path: str | Path) -> int:
    """Bytes of the initializers a one-token step of the graph at ``path`` reads whole: every
    initializer except those read only a row at a time (a token table under a ``Gather`` or
    ``GatherBlockQuantized``, GroupQueryAttention's rotary caches). A weight GEMV at one row
    reads all of its weight, so this is the traffic a step cannot avoid."""
    places = initializer_places(path)
    whole = {name for op, inputs, _ in onnx_nodes(path) for index, name in enumerate(inputs)
             if index not in _ROW_READS.get(op, ())}
    return sum(place.end - place.start for name, place in places.items() if name in whole)


def random_prompts(path: str | Path, batch: int, prompt_tokens: int, seed: int = 0) -> np.ndarray:
    """Seeded token ids [batch, prompt_tokens] within the graph's vocabulary (speed does not read them)."""
    runner = DecodeSession(path, shared_cache=False)   # only its vocabulary is read
    vocab = runner.session.get_outputs()[0].shape[-1]
    high = vocab if isinstance(vocab, int) and vocab > 0 else 256
    return np.random.default_rng(seed).integers(0, high, size=(batch, prompt_tokens), dtype=np.int64)


def decode_bench(models: dict[str, Path], specs: list[SessionSpec], batches: list[int], *, prompt_tokens: int,
                 new_tokens: int, rounds: int = 1, prompt_path: Path | None = None) -> list[dict]:
    """``quantnorm bench --decode``: a ``decode_speed`` row per model x provider x batch, timed in
    ``rounds`` interleaved across the models (a neighbour's load hits them alike); each cell keeps
    its round with the most generation tokens/s, and lists every round's figure. Each row also
    carries ``step_weight_bytes`` (``weights_read_per_step``: what one step reads whole: the
    model's, the graph that generates). ``prompt_path``: a graph that runs every step of more
    than one row beside each model (``DecodeSession``'s ``prompt_model``: a split or one-row
    deployment); the rows are named ``model (prompt: its name)``."""
    if not models or not batches or min(batches) < 1 or rounds < 1:
        raise ConfigError(f"decode bench needs models, batches >= 1 and rounds >= 1, got {list(models)}, "
                          f"{batches}, {rounds}")
    cells: dict[tuple, list[dict]] = {}
    lengths = {}
    for name, path in models.items():
        # a one-line ConfigError for a graph without a cache, or a one-row graph without its prompt graph
        layout = DecodeSession(path, shared_cache=False, prompt_model=prompt_path).layout
        lengths[name] = decode_lengths(layout.max_length, prompt_tokens, new_tokens)
    suffix = f" (prompt: {Path(prompt_path).name})" if prompt_path is not None else ""
    for _ in range(rounds):
        for name, path in models.items():
            prompt, new = lengths[name]
            for spec in specs:
                for batch in batches:
                    prompts = random_prompts(prompt_path or path, batch, prompt)
                    row = decode_speed(path, prompts, new_tokens=new, spec=spec, rounds=1, prompt_path=prompt_path)
                    cells.setdefault((name + suffix, spec.provider, batch), []).append(row)
    step_bytes = {name + suffix: weights_read_per_step(path) for name, path in models.items()}
    out = []
    for (name, _, _), runs in cells.items():
        measured = [r for r in runs if r["status"] == "measured"]
        best = max(measured, key=lambda r: r["gen_tokens_per_s"]) if measured else runs[0]
        out.append({"model": name, **best, "rounds": rounds, "step_weight_bytes": step_bytes[name],
                    "round_gen_tokens_per_s": [r.get("gen_tokens_per_s") for r in runs]})
    return out


def decode_table(rows: list[dict]) -> list[str]:
    """The rows as the terminal table ``quantnorm bench --decode`` prints; ``step MB`` is what a step
    reads whole and ``GB/s`` that x the steps per second (generation tokens/s / batch): the rate a
    step streams its weights at."""
    lines = [f"{'model':<44} {'provider':<10} {'batch':>5} {'prompt':>6} {'new':>4} {'prompt tok/s':>12} "
             f"{'gen tok/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'peak MiB':>9} {'step MB':>8} {'GB/s':>6}"]
    for r in rows:
        head = f"{r['model']:<44} {short_provider(r['provider']):<10} {r['batch']:>5}"
        if r["status"] != "measured":
            lines.append(f"{head} {r['status']}")
            continue
        lines.append(f"{head} {r['prompt_tokens']:>6} {r['new_tokens']:>4} {r['prompt_tokens_per_s']:>12,.0f} "
                     f"{r['gen_tokens_per_s']:>10,.1f} {r['token_ms_p50']:>8.2f} {r['token_ms_p90']:>8.2f} "
                     f"{r['peak_rss_mb']:>9,.0f} {r['step_weight_bytes'] / 1e6:>8,.1f} "
                     f"{r['step_weight_bytes'] * r['gen_tokens_per_s'] / r['batch'] / 1e9:>6.2f}")
    return lines
