"""Measurements on exported models: accuracy (perplexity, KL, top-1), latency per provider, and
the ONNX Runtime sessions both run in (``sessions``: providers that really loaded).

``from quantnorm.measure import compare, bench_grid, SessionSpec`` is the usual entry point.
"""

from .accuracy import AccuracyResult, PerplexityResult, compare, perplexity, run_logits, torch_perplexity
from .latency import LatencyRow, bench_grid, bench_model, node_placement
from .sessions import (
    OPT_LEVELS,
    PROVIDERS,
    ProviderUnavailable,
    SessionSpec,
    make_session,
    provider_status,
    resolve_providers,
)

__all__ = [
    "OPT_LEVELS",
    "PROVIDERS",
    "AccuracyResult",
    "LatencyRow",
    "PerplexityResult",
    "ProviderUnavailable",
    "SessionSpec",
    "bench_grid",
    "bench_model",
    "compare",
    "make_session",
    "node_placement",
    "perplexity",
    "provider_status",
    "resolve_providers",
    "run_logits",
    "torch_perplexity",
]
