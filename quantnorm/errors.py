"""One exception family. The CLI prints a QuantnormError as one line and exits with code 2."""


class QuantnormError(Exception):
    """Base of every error a user can act on; the message says what is wrong and how to fix it."""


class ConfigError(QuantnormError):
    """A configuration value is invalid (unknown name, out of range, inconsistent)."""


class DataError(QuantnormError):
    """The corpus is missing, empty or too small for the requested splits."""


class RunDirError(QuantnormError):
    """A run directory is missing, not a run directory, or cannot be written."""


class ExportError(QuantnormError):
    """ONNX export failed or the exported model does not match PyTorch."""


class QuantizeError(QuantnormError):
    """Quantization failed or produced a broken model."""


class MeasureError(QuantnormError):
    """A measurement could not be taken (bad model file, provider problem)."""
