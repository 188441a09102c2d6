"""Generation agreement: does a quantized model generate what the FP32 model generates?

Greedy generation from the same prompts (windows of the evaluation split, cut to a prompt) by
both with-past graphs, position by position (``greedy_decode``: no stop token), then:

- ``first_divergence_mean``: the mean over prompts of the first position where the candidate's
  token differs from FP32's (``new_tokens`` for a prompt that never diverged);
- ``identical_before_divergence``: the share of all generated tokens that came before a prompt's
  first divergence (1.0: every generation identical to FP32's);
- ``identical_prompts``: how many prompts generated exactly FP32's tokens;
- ``first_divergence``: each prompt's first divergence (a paired test between two recipes reads it);
- ``kl_mean`` / ``kl_max`` along FP32's own continuation: both models teacher-forced on the
  prompt followed by FP32's tokens, KL(FP32 || candidate) of the next-token distribution at each
  generated position (so a divergence does not send the two down different texts);
- ``top1_along_fp32``: the share of those positions where the candidate's argmax is FP32's token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..measure.accuracy import PairLadder
from .decode import DecodeSession, greedy_decode, rows_within_budget

DEFAULT_PROMPTS = 16
DEFAULT_NEW_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 64


# At most this many prompts run together (greedy decoding, teacher forcing); fewer when their
# logits would pass decode.LOGITS_BUDGET_BYTES (a large vocabulary: Gemma 3's takes 2 at a time).
MAX_CHUNK = 8


@dataclass(frozen=True)
class Continuation:
    """FP32's greedy tokens from ``prompts`` (computed once per run) and its with-past graph, which
    gives its logits along them again, a chunk at a time, beside each candidate's."""
    prompts: np.ndarray       # [n, prompt]
    tokens: np.ndarray        # [n, new]
    fp32: DecodeSession


def agreement_prompts(eval_inputs: np.ndarray, max_length: int | None, *, n: int = DEFAULT_PROMPTS,
                      prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                      new_tokens: int = DEFAULT_NEW_TOKENS) -> tuple[np.ndarray, int]:
    """(prompts [n, prompt], new tokens): the first ``n`` evaluation windows cut to
    ``prompt_tokens``, the prompt shortened so that prompt + new tokens fit ``max_length``."""
    windows = np.asarray(eval_inputs, dtype=np.int64)
    if windows.ndim != 2 or len(windows) == 0:
        raise ConfigError(f"generation agreement needs evaluation windows [n, seq], got {windows.shape}")
    prompt = min(prompt_tokens, windows.shape[1])
    if max_length is not None and prompt + new_tokens > max_length:
        new_tokens = min(new_tokens, max_length // 2)
        prompt = min(prompt, max_length - new_tokens)
    if prompt < 1 or new_tokens < 1:
        raise ConfigError(f"a model of {max_length} positions leaves no room for a prompt and new tokens")
    return np.ascontiguousarray(windows[:n, :prompt]), new_tokens


def _teacher_forced(runner: DecodeSession, prompts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Logits [n, new, vocab] predicting each of ``tokens`` after its prompt and the tokens before it."""
    sequence = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    runner.reset(len(sequence), sequence.shape[1])
    if runner.split:   # as it generates: the prompt on the prompt graph, then a token per step on the token graph
        # (one row per step also because ORT's GroupQueryAttention takes several rows after a past at batch 1 only)
        steps = [runner.step(prompts, last_only=True)]
        steps += [runner.step(tokens[:, t:t + 1]) for t in range(tokens.shape[1] - 1)]
        return np.concatenate(steps, axis=1)
    # a copy: the prompt's own positions (most of the array for a short continuation) are let go
    return np.ascontiguousarray(runner.step(sequence)[:, prompts.shape[1] - 1:])


def _chunk(runner: DecodeSession, prompts: np.ndarray, new_tokens: int) -> int:
    if runner.one_row:   # its token graph takes a step of one row only: a prompt at a time reaches it
        return 1
    return rows_within_budget(prompts.shape[1] + new_tokens, runner.vocab, MAX_CHUNK)


def _greedy(runner: DecodeSession, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy tokens, a chunk of prompts at a time (the prompt step's logits are [chunk, prompt, vocab])."""
    step = _chunk(runner, prompts, new_tokens)
    return np.concatenate([greedy_decode(runner, prompts[lo:lo + step], new_tokens)
                           for lo in range(0, len(prompts), step)])


def fp32_continuation(fp32_path, prompts: np.ndarray, new_tokens: int, *, threads: int | None = 1) -> Continuation:
    runner = DecodeSession(fp32_path, threads=threads)
    return Continuation(prompts, _greedy(runner, prompts, new_tokens), runner)


def generation_agreement(candidate_path, reference: Continuation, *, threads: int | None = 1,
                         prompt_path=None) -> dict:
    """The candidate's agreement with FP32's continuation (see the module doc); ``prompt_path``:
    a split deployment's prompt graph (``DecodeSession``)."""
    runner = DecodeSession(candidate_path, threads=threads, prompt_model=prompt_path)
    new = reference.tokens.shape[1]
    return agreement_of(_greedy(runner, reference.prompts, new), lambda p, t: _teacher_forced(runner, p, t),
                        reference, step=max(1, _chunk(runner, reference.prompts, new) // 2))  # two models' logits


def engine_agreement(greedy: Callable, logits: Callable, vocab: int, reference: Continuation) -> dict:
    """``generation_agreement`` of a model another engine runs: ``greedy(prompts, new)`` -> tokens
    [n, new]; ``logits(windows)`` -> [n, seq, vocab], each window from an empty cache."""
    prompts, new = reference.prompts, reference.tokens.shape[1]

    def teacher_forced(p: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return logits(np.concatenate([p, tokens[:, :-1]], axis=1))[:, p.shape[1] - 1:]
    step = max(1, rows_within_budget(prompts.shape[1] + new, vocab, MAX_CHUNK) // 2)
    return agreement_of(np.asarray(greedy(prompts, new)), teacher_forced, reference, step=step)


def agreement_of(tokens: np.ndarray, teacher_forced: Callable, reference: Continuation, *, step: int) -> dict:
    """The statistics of the module doc: the candidate's greedy ``tokens`` [n, new] against FP32's,
    and its logits along FP32's continuation (``teacher_forced(prompts, fp32_tokens)`` -> [k, new,
    vocab]) beside FP32's own, ``step`` prompts at a time."""
    n, new = reference.tokens.shape
    differs = tokens != reference.tokens
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), new)
    ladder = PairLadder()
    for lo in range(0, n, step):
        prompts, fp32_tokens = reference.prompts[lo:lo + step], reference.tokens[lo:lo + step]
        ladder.add(_teacher_forced(reference.fp32, prompts, fp32_tokens), teacher_forced(prompts, fp32_tokens),
                   fp32_tokens)
    kld = ladder.kld
    return {"prompts": n, "prompt_tokens": int(reference.prompts.shape[1]), "new_tokens": new,
            "identical_before_divergence": round(float(first.sum()) / (n * new), 6),
            "first_divergence_mean": round(float(first.mean()), 3),
            "identical_prompts": int((first == new).sum()),
            "first_divergence": [int(x) for x in first],
            "kl_mean": float(kld.mean()), "kl_max": float(kld.max()),
            "top1_along_fp32": round(ladder.agree / kld.size, 6)}
