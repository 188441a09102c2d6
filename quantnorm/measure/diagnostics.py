"""Model diagnostics the literature's claims are about (shared CLAIMS.md), measured in PyTorch.

- ``perturbation_sensitivity``: Liu et al. 2020 say Post-LN amplifies parameter perturbations far
  more than Pre-LN. We add Gaussian noise to every parameter, scaled to a relative size of that
  parameter's RMS, and report the relative change of the logits ||f(W+dW) - f(W)|| / ||f(W)||.
- ``block_output_similarity``: the ResiDual paper says deep Pre-LN stacks lose representation
  diversity. We report the mean cosine similarity between each block's output and its input
  (the previous block's output, or the embedding for block 0), per token.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..models import CausalLM

DEFAULT_NOISE_LEVELS = (1e-3, 1e-2)


@torch.no_grad()
def _logits(model: CausalLM, inputs: np.ndarray, batch_size: int = 16) -> torch.Tensor:
    return torch.cat([model(torch.from_numpy(inputs[i:i + batch_size])) for i in range(0, len(inputs), batch_size)])


@torch.no_grad()
def perturbation_sensitivity(model: CausalLM, inputs: np.ndarray, noise_levels=DEFAULT_NOISE_LEVELS,
                             repeats: int = 3, seed: int = 0) -> list[dict]:
    """Relative logit change per relative noise level, mean and spread over ``repeats`` draws.

    Each parameter tensor p gets noise with per-entry std ``level * rms(p)``; parameters that are
    all zero (fresh biases) get none, since they have no scale to be relative to.
    """
    model = model.eval()
    reference = _logits(model, inputs)
    ref_norm = float(torch.linalg.vector_norm(reference))
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for level in noise_levels:
        changes = []
        for _ in range(repeats):
            noisy = copy.deepcopy(model)
            for p in noisy.parameters():
                rms = p.pow(2).mean().sqrt()
                p.add_(torch.randn(p.shape, generator=generator) * (level * rms))
            delta = _logits(noisy, inputs) - reference
            changes.append(float(torch.linalg.vector_norm(delta)) / ref_norm)
        rows.append({"relative_noise": level, "relative_logit_change": float(np.mean(changes)),
                     "std": float(np.std(changes)), "repeats": repeats})
    return rows


@torch.no_grad()
def block_output_similarity(model: CausalLM, inputs: np.ndarray, batch_size: int = 16) -> list[float]:
    """Mean per-token cosine similarity between each block's output and its input (main stream)."""
    model = model.eval()
    sums = np.zeros(len(model.blocks))
    count = 0

    def hook(index):
        def fn(module, args, output):
            before, after = args[0][0], output[0]
            sums[index] += float(torch.nn.functional.cosine_similarity(before, after, dim=-1).sum())
        return fn

    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(model.blocks)]
    try:
        for i in range(0, len(inputs), batch_size):
            batch = torch.from_numpy(inputs[i:i + batch_size])
            model(batch)
            count += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return (sums / count).tolist()


def diagnostics(model: CausalLM, inputs: np.ndarray) -> dict:
    """The ``diagnostics`` section of results.json."""
    return {
        "perturbation": perturbation_sensitivity(model, inputs),
        "block_cosine": block_output_similarity(model, inputs),
    }
