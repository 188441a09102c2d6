"""What an ONNX graph is fed to score token windows whole.

A whole-window graph takes one input, the token ids. A with-past graph (the KV-cache export of
``quantnorm.generation``, or any export under Optimum's names) takes the ids, an attention mask,
positions and the cache; scoring a window whole is one step after an empty cache (past length 0),
with an all-ones mask and positions 0..seq-1. Every stage that runs a graph on windows
(calibration, GPTQ's statistics, the probe, accuracy, SQNR, latency) builds its feed here, so
every recipe quantizes and is measured on either kind of graph the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
ATTENTION_MASK = "attention_mask"
LOGITS_TO_KEEP = "logits_to_keep"   # a with-past graph's optional input (generation/decode.py)
POSITION_IDS = "position_ids"
_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
           "tensor(int32)": np.int32}


def is_with_past(session) -> bool:
    """Whether the graph (an ORT session, or anything with ``get_inputs()``) takes a KV cache."""
    return any(PAST_INPUT.match(i.name) for i in session.get_inputs())


def window_feeder(session) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """``ids [batch, seq] -> feed`` for ``session``'s graph: ``{first input: ids}`` for a
    whole-window graph; the ids, mask, positions and an empty cache for a with-past one."""
    inputs = list(session.get_inputs())
    first = inputs[0].name
    if not any(PAST_INPUT.match(i.name) for i in inputs):
        return lambda ids: {first: np.ascontiguousarray(ids, dtype=np.int64)}
    extra = inputs[1:]

    def feed(ids: np.ndarray) -> dict[str, np.ndarray]:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch, seq = ids.shape
        out = {first: ids}
        for arg in extra:
            dtype = _DTYPES.get(arg.type, np.int64)
            if arg.name == ATTENTION_MASK:
                out[arg.name] = np.ones((batch, seq), dtype)
            elif arg.name == POSITION_IDS:
                out[arg.name] = np.ascontiguousarray(np.broadcast_to(np.arange(seq, dtype=dtype), (batch, seq)))
            elif PAST_INPUT.match(arg.name):
                _, heads, _, head_dim = arg.shape
                out[arg.name] = np.zeros((batch, heads, 0, head_dim), dtype)
            elif arg.name == LOGITS_TO_KEEP:   # required where a tapped copy dropped its default: 0, every position
                out[arg.name] = np.zeros(1, np.int64)
        return out
    return feed
