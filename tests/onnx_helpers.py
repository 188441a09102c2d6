"""Small helpers shared by tests that run ONNX models."""

import numpy as np

from quantnorm.measure.accuracy import run_logits
from quantnorm.measure.sessions import SessionSpec, make_session


def onnx_logits(path, inputs: np.ndarray) -> np.ndarray:
    """All logits of an ONNX LM on the CPU provider (ORT_ENABLE_ALL), concatenated over batches."""
    return np.concatenate(list(run_logits(make_session(path, SessionSpec()), inputs)))
