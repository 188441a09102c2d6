"""Generation as deployed: a causal model exported with a KV cache, run a step at a time.

- ``with_past``: the with-past export (zoo and Hugging Face causal models) and its parity gate;
- ``decode``: the with-past graph on ONNX Runtime (the cache carried between steps), greedy
  decoding, and the cache proof (scoring through the cache equals scoring whole windows);
- ``bundle``: a run's with-past model as a directory ONNX Runtime GenAI loads (``quantnorm bundle``).
"""
from .decode import CacheCheck, DecodeSession, PastLayout, check_cache, greedy_decode, past_names, present_names
from .with_past import HFWithPast, WithPastExportResult, ZooWithPast, export_with_past, torch_step

__all__ = [
    "CacheCheck", "DecodeSession", "PastLayout", "check_cache", "greedy_decode", "past_names", "present_names",
    "HFWithPast", "WithPastExportResult", "ZooWithPast", "export_with_past", "torch_step",
]
