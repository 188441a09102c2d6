"""Real checkpoints from local Hugging Face directories (the optional extra ``quantnorm[hf]``).

    quantnorm evaluate --model PATH        # config.json + model.safetensors + tokenizer files

- ``loader``: the detection table (``model_type`` -> placement / norm / module roles), local-only
  loading (never ``trust_remote_code``, no pickled weights without ``--allow-pickle``) and a
  check of the detected placement on the loaded model;
- ``data``: the corpus splits tokenized with the checkpoint's own tokenizer (token-level windows);
- ``export``: wrappers (logits; or last hidden state + pooled embedding) and the parity gate;
- ``metrics``: token-level PPL / KL / top-1 and encoder embedding agreement;
- ``probe``: the outlier probe on HF modules (the zoo's statistics).

The source adapter that runs a checkpoint through the one pipeline is ``quantnorm.sources.hf``.

Importing this package does not import transformers; loading a checkpoint does.
"""

from .loader import ARCHITECTURES, ArchSpec, get_arch, inspect_checkpoint, supported_architectures

__all__ = ["ARCHITECTURES", "ArchSpec", "get_arch", "inspect_checkpoint", "supported_architectures"]
