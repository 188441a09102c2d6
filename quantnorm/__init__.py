"""quantnorm: does a Transformer's normalization placement survive INT8 deployment?

The pipeline runs data -> model -> train -> export -> quantize -> measure -> report -> gate;
each stage is a module of this package with one job and a typed result.
"""

__version__ = "0.1.0"
