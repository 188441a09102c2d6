"""Transforms that act on any model before it is quantized: the Hadamard rotation, SmoothQuant,
GPTQ rounding. They take what a source gives (a torch module, its fold rules, an FP32 graph) and
never import a source."""
