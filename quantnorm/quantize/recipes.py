"""Named quantization recipes: one frozen dataclass each, chosen by name from ``RECIPES``.

A recipe says *what* to quantize and how to calibrate; the backend (``ort_backend``) turns it
into ONNX Runtime calls. A new recipe is one entry in ``_RECIPE_LIST``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

from ..calibration import CALIBRATION_METHODS
from ..errors import ConfigError
from ..generation.decode import CHECKPOINT_VALUES

# "pertoken": weights INT8 per output channel offline, activations quantized per row (token) at
#             run time with standard ONNX ops (quantize/pertoken.py); the massive-activation remedy.
# "fp16": no integers at all: every float tensor in float16 (the GPU precision), a variant measured
# beside the INT8 recipes (its file still goes by the recipe name: model.int8.fp16.onnx).
# "weight-only": the weights in 4 or 8 bits per block along K, ONNX Runtime's MatMulNBits
#             (quantize/weight_only.py): what llama.cpp and ONNX Runtime GenAI users deploy instead.
MODES = ("static", "dynamic", "pertoken", "fp16", "weight-only")
# "matmul": only MatMuls whose second input is a weight initializer (the Linear layers and the
#           LM head). Activation x activation MatMuls (q @ k^T, probs @ v) and everything else
#           stay FP32, so the attention scores and the softmax are never calibrated (PITFALLS.md 1).
# "all":    ONNX Runtime's default op list (Add, Mul, MatMul, Softmax, Where, Gather, ...).
OP_SCOPES = ("matmul", "all")
# "hadamard": the residual stream rotated and folded (QuaRot, Pre-RMSNorm); "online": every
# Linear's input rotated in the graph (exact for any placement; quantnorm.transforms.rotation);
# "block<b>" (weight-only recipes with int8 activations per block of b): a Hadamard inside each of
# those blocks of every Linear's input, one MatMul each (BLOCK_ROTATION). "stream-block<b>" (the
# same recipes, Pre-RMSNorm): the stream rotated as "hadamard" does, the down-projection's input
# inside blocks of b (one MatMul) and the attention output inside blocks of b of each head, folded
# into the value and o-projections (no operator): a third of block<b>'s operators in a step.
ROTATIONS = (None, "hadamard", "online")
BLOCK_ROTATION = "block"
STREAM_BLOCK_ROTATION = "stream-block"
PERTOKEN_KERNELS = ("standard", "ort-fused")
CARRIER_MODES = (None, "fp32", "pertoken")
# "hqq": Half-Quadratic Quantization (ORT's HQQ quantizer; weight-only 4-bit only).
WEIGHT_ROUNDINGS = ("nearest", "gptq", "hqq")
# Weight-only (MatMulNBits). accuracy_level 0: float activations (the weights dequantized in the
# kernel); 4: the activations quantized to int8 per block of ``block_size`` along K at run time
# and an int8 x int8 GEMM (ORT GenAI's CPU default; onnxruntime issue #29849: it flips greedy
# tokens on models with massive activations). Levels 1-3 choose a float compute type only.
WEIGHT_ONLY_BITS = (4, 8)
WEIGHT_ONLY_BLOCKS = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 4)
# pertoken only: how the MatMul inputs that are a norm's output get their activation scale.
# "pertoken": like every other input, one scale per row at run time. "calibrated": one scale per
# tensor from the calibration windows (an MSE-optimal clip / 127), on the rotated stream only,
# where the fold set every norm weight to 1 so that each row of a norm output has RMS 1 and the
# Hadamard spread its energy evenly: one step then suits every row, and the kernel skips the
# per-row rescale of its output (ORT's MatMulIntegerToFloat folds a scalar scale into the GEMM
# and applies a per-row one in a pass of its own after it, which nearly doubles a multi-threaded
# GEMM's time; benchmarks/pertoken_kernel.py measures both).
NORM_INPUT_SCALES = ("pertoken", "calibrated")


@dataclass(frozen=True)
class Recipe:
    name: str
    mode: str                 # "static" (QDQ, calibrated activations) | "dynamic" (activations per batch)
    calibration: str | None   # key of CALIBRATION_METHODS; static only
    per_channel: bool         # weight scales per output channel instead of one per tensor
    op_scope: str             # see OP_SCOPES
    symmetric_activations: bool  # QInt8 activations with zero point 0 instead of asymmetric QUInt8
    reduce_range: str | bool  # 7-bit weights; "auto" = on when the CPU lacks VNNI (PITFALLS.md 2)
    percentile: float = 99.999   # percentile calibration only
    excluded: tuple[str, ...] = ()  # node names or fnmatch patterns kept in FP32 (mixed precision)
    # SmoothQuant migration strength; None = no smoothing. A recipe with an alpha quantizes the
    # smoothed FP32 model (quantnorm.transforms.smoothquant.export_smoothed), not the plain export.
    smoothquant_alpha: float | None = None
    # "hadamard": quantize the rotated FP32 model (residual stream rotated, online Hadamard before
    # each down-projection; quantnorm.transforms.rotation), not the plain export. None: no rotation.
    rotation: str | None = None
    # pertoken only: "standard" ONNX ops (MatMulInteger + Muls, any runtime) or ORT's fused
    # com.microsoft.MatMulIntegerToFloat ("ort-fused").
    pertoken_kernel: str = "standard"
    # Static recipes only: the weight MatMuls whose inputs carry a massive activation, found by the
    # graph probe on calibration windows, kept in FP32 ("fp32") or quantized per token ("pertoken",
    # ORT's fused kernel) while the rest stay static. None: every weight MatMul as the recipe says.
    carriers: str | None = None
    # pertoken only: how the INT8 weight codes are chosen on the per-channel grid. "nearest":
    # round to nearest; "gptq": GPTQ's error-compensating rounding against the calibration
    # activations (quantize/gptq.py).
    weight_rounding: str = "nearest"
    # pertoken only: see NORM_INPUT_SCALES ("calibrated" needs the stream rotation).
    norm_inputs: str = "pertoken"
    # weight-only only: bits per weight (WEIGHT_ONLY_BITS), weights per scale along K
    # (WEIGHT_ONLY_BLOCKS), MatMulNBits' accuracy_level (ACCURACY_LEVELS), and whether the LM head
    # is quantized too (False: kept float32; the embedding is a Gather: see embedding_bits).
    weight_bits: int | None = None
    block_size: int | None = None
    accuracy_level: int = 0
    quantize_head: bool = True
    # weight-only only: symmetric codes (one scale per block, the default zero point; llama.cpp's
    # Q4_0/Q8_0) or asymmetric ones (a scale and a uint8 zero point per block; Q4_1's kind).
    weight_symmetric: bool = True
    # The token embedding table: None keeps it float32 (every quantizer here takes MatMuls only);
    # 8 stores it as int8 per block of 32 (quantize/embedding.py; names ending EMBEDDING_SUFFIX).
    embedding_bits: int | None = None

    def __post_init__(self) -> None:
        # The name goes into file names (model.int8.<name>.onnx) and results.json.
        if not self.name or any(c in self.name for c in '/\\:*?"<>| '):
            raise ConfigError(f"recipe name {self.name!r} cannot be used in a file name")
        if self.mode not in MODES:
            raise ConfigError(f"recipe {self.name}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.op_scope not in OP_SCOPES:
            raise ConfigError(f"recipe {self.name}: op_scope must be one of {', '.join(OP_SCOPES)}, got {self.op_scope!r}")
        self._check_weight_only()
        if self.embedding_bits not in (None, 8) or (self.embedding_bits and self.mode == "fp16"):
            raise ConfigError(f"recipe {self.name}: embedding_bits is None (float32) or 8 (int8 blocks), on an "
                              f"integer recipe, got {self.embedding_bits!r}")
        if self.mode == "fp16" and (self.per_channel or self.symmetric_activations or self.reduce_range is not False
                                    or self.op_scope != "all"):
            raise ConfigError(f"recipe {self.name}: an fp16 variant converts the whole graph (op_scope 'all') and "
                              "has no INT8 settings (per_channel, symmetric_activations, reduce_range off)")
        if self.mode == "static":
            if self.calibration not in CALIBRATION_METHODS:
                raise ConfigError(
                    f"recipe {self.name}: static quantization needs a calibration method, one of "
                    f"{', '.join(CALIBRATION_METHODS)} (got {self.calibration!r})"
                )
        else:
            if self.calibration is not None:
                raise ConfigError(f"recipe {self.name}: {self.mode} quantization takes no calibration method")
            if self.mode == "pertoken" and (self.op_scope != "matmul" or not self.per_channel):
                raise ConfigError(f"recipe {self.name}: per-token quantization covers weight MatMuls with "
                                  "per-channel weights only")
            if self.symmetric_activations:
                raise ConfigError(f"recipe {self.name}: dynamic quantization uses ORT's asymmetric uint8 activations only")
        if self.reduce_range not in ("auto", True, False):
            raise ConfigError(f"recipe {self.name}: reduce_range must be 'auto', True or False, got {self.reduce_range!r}")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"recipe {self.name}: percentile must be in (0, 100], got {self.percentile}")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ConfigError(f"recipe {self.name}: weight_rounding must be one of {WEIGHT_ROUNDINGS}, "
                              f"got {self.weight_rounding!r}")
        if self.weight_rounding == "gptq" and self.mode not in ("pertoken", "weight-only"):
            raise ConfigError(f"recipe {self.name}: GPTQ rounding is built for the per-token and weight-only recipes only")
        if self.norm_inputs not in NORM_INPUT_SCALES:
            raise ConfigError(f"recipe {self.name}: norm_inputs must be one of {NORM_INPUT_SCALES}, "
                              f"got {self.norm_inputs!r}")
        if self.norm_inputs == "calibrated" and (self.mode != "pertoken" or self.rotation != "hadamard"):
            raise ConfigError(f"recipe {self.name}: calibrated norm-input scales need a per-token recipe on the "
                              "rotated stream (rotation 'hadamard': the fold that gives every norm-output row RMS 1)")
        if self.carriers not in CARRIER_MODES:
            raise ConfigError(f"recipe {self.name}: carriers must be one of {CARRIER_MODES}, got {self.carriers!r}")
        if self.carriers is not None and (self.mode != "static" or self.op_scope != "matmul"):
            raise ConfigError(f"recipe {self.name}: carriers apply to static weight-MatMul recipes only")
        if isinstance(self.excluded, str) or not all(isinstance(p, str) and p for p in self.excluded):
            raise ConfigError(f"recipe {self.name}: excluded must be a tuple of non-empty node names or patterns")
        if self.pertoken_kernel not in PERTOKEN_KERNELS:
            raise ConfigError(f"recipe {self.name}: pertoken_kernel must be one of {PERTOKEN_KERNELS}")
        if self.rotation not in ROTATIONS and self.rotation not in (f"{BLOCK_ROTATION}{self.block_size}",
                                                                     f"{STREAM_BLOCK_ROTATION}{self.block_size}"):
            raise ConfigError(f"recipe {self.name}: rotation must be one of {ROTATIONS} or, on a weight-only recipe "
                              f"with int8 activations, {BLOCK_ROTATION}<its block size> or "
                              f"{STREAM_BLOCK_ROTATION}<its block size>; got {self.rotation!r}")
        if str(self.rotation).startswith((BLOCK_ROTATION, STREAM_BLOCK_ROTATION)) and self.accuracy_level != 4:
            raise ConfigError(f"recipe {self.name}: a block rotation serves activations quantized per block "
                              "(accuracy_level 4, -acc4)")
        if self.rotation is not None and self.smoothquant_alpha is not None:
            raise ConfigError(f"recipe {self.name}: rotation and SmoothQuant are alternatives, not combined here")
        if self.smoothquant_alpha is not None and not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ConfigError(f"recipe {self.name}: smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")

    def _check_weight_only(self) -> None:
        """The weight-only fields: set on weight-only recipes, left at their defaults on the others."""
        if self.mode != "weight-only":
            if (self.weight_bits, self.block_size, self.accuracy_level, self.quantize_head,
                    self.weight_symmetric) != (None, None, 0, True, True):
                raise ConfigError(f"recipe {self.name}: weight_bits, block_size, accuracy_level, quantize_head and "
                                  "weight_symmetric apply to weight-only recipes only")
            if self.weight_rounding == "hqq":
                raise ConfigError(f"recipe {self.name}: HQQ rounding is for the weight-only recipes only")
            return
        if self.calibration is not None or self.op_scope != "matmul" or not self.per_channel \
                or self.symmetric_activations or self.reduce_range is not False:
            raise ConfigError(f"recipe {self.name}: a weight-only recipe quantizes the weight MatMuls (op_scope "
                              "'matmul', per_channel on, no calibration method, no activation settings, "
                              "reduce_range False)")
        if self.weight_bits not in WEIGHT_ONLY_BITS:
            raise ConfigError(f"recipe {self.name}: weight_bits must be one of {WEIGHT_ONLY_BITS}, got {self.weight_bits!r}")
        if self.block_size not in WEIGHT_ONLY_BLOCKS:
            raise ConfigError(f"recipe {self.name}: block_size must be one of {WEIGHT_ONLY_BLOCKS}, "
                              f"got {self.block_size!r}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"recipe {self.name}: accuracy_level must be one of {ACCURACY_LEVELS} (0: float "
                              f"activations, 4: int8 activations per block), got {self.accuracy_level!r}")
        if self.weight_rounding == "hqq" and (self.weight_bits != 4 or self.accuracy_level != 0):
            raise ConfigError(f"recipe {self.name}: HQQ is 4-bit at accuracy_level 0 only (its float zero points "
                              "run on ORT's float path: 8 bits fail there and accuracy_level 4 is ignored)")
        if not self.weight_symmetric and self.weight_rounding != "nearest":
            raise ConfigError(f"recipe {self.name}: asymmetric weights are round-to-nearest only (GPTQ's codes here "
                              "are on the symmetric grid; HQQ has float zero points of its own)")
        if self.pertoken_kernel != "standard" or self.smoothquant_alpha is not None:
            raise ConfigError(f"recipe {self.name}: a weight-only recipe takes no per-token kernel or SmoothQuant")

    def resolved_reduce_range(self, vnni: bool) -> bool:
        """7-bit weights in ONNX Runtime's quantizer unless the CPU has VNNI (u8s8 kernels without
        VNNI can saturate). Per-token INT8 avoids the saturation with all 8 bits instead
        (``unsigned_pertoken_weights``), so a per-token recipe never reduces the range on "auto"."""
        if self.reduce_range == "auto":
            return not vnni and self.mode != "pertoken"
        return bool(self.reduce_range)

    def unsigned_pertoken_weights(self, vnni: bool) -> bool:
        """Per-token weights stored as uint8 (code + 128, zero point 128): the u8 x u8 kernel, exact
        on a CPU without VNNI, with the same 8-bit codes a VNNI CPU runs (quantize.pertoken)."""
        return self.reduce_range == "auto" and not vnni and (self.mode == "pertoken" or self.carriers == "pertoken")

    def embedding_setting(self) -> str:
        """What the recipe does with the token embedding table (the quantizer records what it found)."""
        if self.embedding_bits:
            return "int8, one scale per block of 32 along the hidden axis (GatherBlockQuantized)"
        return "float32 (a Gather: the weight quantizers take MatMuls only)"

    def op_types(self) -> list[str]:
        """The op types handed to ONNX Runtime: MatMul, or its whole default list for this mode."""
        if self.mode == "fp16":
            return []
        if self.op_scope == "matmul":
            return ["MatMul"]
        from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry, QLinearOpsRegistry

        if self.mode != "static":
            return sorted(IntegerOpsRegistry)
        return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))

    def settings(self, vnni: bool) -> dict:
        """The ``recipes[].settings`` object of results.json (everything needed to redo it)."""
        if self.mode == "fp16":
            return {"format": "FP16", "mode": "fp16", "weight_type": "float16", "activation_type": "float16",
                    "conversion": "quantnorm.quantize.fp16 (float32 graph inputs and outputs)",
                    "excluded_nodes": list(self.excluded)}
        if self.mode == "weight-only":
            return self._weight_only_settings()
        static = self.mode == "static"
        out = {
            "format": "QDQ" if static else ("QOperator" if self.mode == "dynamic" else
                                            "per-token (standard ONNX ops: MatMulInteger + per-row scales)"),
            "mode": self.mode,
            "calibration": self.calibration,
            "per_channel": self.per_channel,
            "reduce_range": self.resolved_reduce_range(vnni),
            "reduce_range_setting": self.reduce_range,
            "op_scope": self.op_scope,
            "op_types": self.op_types(),
            "weight_matmuls_only": self.op_scope == "matmul",
            "activation_type": ("QInt8" if self.symmetric_activations else "QUInt8") if static else
                               ("QUInt8 (dynamic)" if self.mode == "dynamic" else "QUInt8 per token, zero point 128"),
            "weight_type": "QInt8",
            "unsigned_pertoken_weights": self.unsigned_pertoken_weights(vnni),
            "symmetric_activations": self.symmetric_activations,
            "symmetric_weights": True,
            "excluded_nodes": list(self.excluded),
            "embedding": self.embedding_setting(),
        }
        if self.calibration == "percentile":
            out["percentile"] = self.percentile
        if self.smoothquant_alpha is not None:
            out["smoothquant_alpha"] = self.smoothquant_alpha
        if self.rotation is not None:
            out["rotation"] = self.rotation
        if self.mode == "pertoken":
            out["pertoken_kernel"] = self.pertoken_kernel
        if self.carriers is not None:
            out["carriers"] = self.carriers
        if self.mode == "pertoken":
            out["weight_rounding"] = self.weight_rounding
            out["norm_inputs"] = self.norm_inputs
        return out

    def _weight_only_settings(self) -> dict:
        hqq = self.weight_rounding == "hqq"
        out = {"format": "MatMulNBits", "mode": "weight-only", "op": "com.microsoft.MatMulNBits",
               "bits": self.weight_bits, "block_size": self.block_size, "accuracy_level": self.accuracy_level,
               "weight_type": (f"uint{self.weight_bits} with a float scale and zero point per block (HQQ)" if hqq else
                               f"int{self.weight_bits} symmetric, one scale per block of {self.block_size} along K "
                               "per output channel" if self.weight_symmetric else
                               f"uint{self.weight_bits} asymmetric, one scale and uint8 zero point per block of "
                               f"{self.block_size} along K per output channel"),
               "symmetric_weights": self.weight_symmetric and not hqq,
               "activation_type": ("float32 (the weights dequantized in the kernel)" if self.accuracy_level == 0 else
                                   f"int8, one scale per block of {self.block_size} along K, at run time "
                                   "(accuracy_level 4)"),
               "weight_rounding": self.weight_rounding, "head": "quantized" if self.quantize_head else "float32",
               "embedding": self.embedding_setting(),
               "calibration": "GPTQ's X^T X on the calibration windows" if self.weight_rounding == "gptq" else None,
               "per_channel": True, "reduce_range": False, "op_scope": self.op_scope, "op_types": self.op_types(),
               "weight_matmuls_only": True, "excluded_nodes": list(self.excluded)}
        if self.rotation is not None:
            out["rotation"] = self.rotation
        return out

    def _describe_weight_only(self) -> str:
        rounding = {"nearest": "round-to-nearest", "gptq": "GPTQ rounding (calibrated)", "hqq": "HQQ (float zero points)"}
        parts = [f"weight-only MatMulNBits: int{self.weight_bits} weights per block of {self.block_size} along K"
                 + ("" if self.weight_symmetric else " (asymmetric: a zero point per block)") + ", "
                 + ("float activations (accuracy_level 0)" if self.accuracy_level == 0
                    else "int8 activations per block at run time (accuracy_level 4)"),
                 rounding[self.weight_rounding], "LM head " + ("quantized" if self.quantize_head else "kept float32")]
        if self.rotation == "hadamard":
            parts.append("on the Hadamard-rotated model (residual stream; Pre-RMSNorm checkpoints)")
        elif self.rotation == "online":
            parts.append("every Linear's input Hadamard-rotated online (any placement)")
        elif self.rotation == f"{STREAM_BLOCK_ROTATION}{self.block_size}":
            parts.append(f"on the Hadamard-rotated model (residual stream; Pre-RMSNorm checkpoints), the "
                         f"down-projection's input rotated online inside each activation block of {self.block_size} "
                         "(one MatMul) and each head's values inside those blocks (folded: no operator)")
        elif self.rotation is not None:
            parts.append(f"every Linear's input Hadamard-rotated online inside each activation block of "
                         f"{self.block_size} (one MatMul per input; any placement)")
        if self.excluded:
            parts.append(f"{len(self.excluded)} node pattern(s) kept in FP32")
        return ", ".join(parts)

    @property
    def value_cache(self) -> str:
        """What a with-past graph of this recipe keeps in its value cache: the checkpoint's values, or
        (form d) each head's values rotated inside blocks. Two graphs share one cache only when this is
        the same (the keys are the checkpoint's under every rotation); a with-past graph states it in
        its metadata where it is not the checkpoint's (``generation.decode.VALUE_CACHE_KEY``)."""
        if str(self.rotation).startswith(STREAM_BLOCK_ROTATION):
            return f"each head's values rotated inside blocks of {self.block_size}"
        return CHECKPOINT_VALUES

    @property
    def rotates_stream(self) -> bool:
        """Whether this recipe quantizes a model whose residual stream is rotated (the norms folded:
        Pre-RMSNorm checkpoints with a fold rule only)."""
        return self.rotation == "hadamard" or str(self.rotation).startswith(STREAM_BLOCK_ROTATION)

    def describe(self) -> str:
        """One line saying what the recipe does (``quantnorm recipes``), built from the fields so
        that a new recipe describes itself."""
        text = self._describe_quantization()
        return text + ", the token embedding in int8 blocks of 32" if self.embedding_bits else text

    def _describe_quantization(self) -> str:
        if self.mode == "weight-only":
            return self._describe_weight_only()
        if self.mode == "fp16":
            return ("FP16: every float tensor in float16, float32 inputs and outputs (the GPU precision; "
                    "the CPU provider computes it in float32)")
        if self.mode == "dynamic":
            parts = ["dynamic: INT8 weights, activations quantized per batch at run time"]
        elif self.mode == "pertoken":
            parts = ["per-token dynamic: INT8 weights, each token's activations with its own scale at run time ("
                     + ("ORT's fused MatMulIntegerToFloat" if self.pertoken_kernel == "ort-fused"
                        else "standard ONNX ops") + ")"]
        else:
            ranges = {"minmax": "MinMax ranges", "minmax-nosink": "MinMax ranges over every token but the sink "
                      "(position 0: its values are clipped)", "entropy": "entropy calibration (KL-optimal clipping)",
                      "percentile": f"{self.percentile:g}th-percentile clipping",
                      "distribution": "distribution calibration (symmetric ranges)"}
            parts = [f"static QDQ, {ranges.get(self.calibration, f'{self.calibration} calibration')}"]
        parts.append("weight MatMuls only" if self.op_scope == "matmul" else "ONNX Runtime's default op list")
        parts.append("per-channel weights" if self.per_channel else "one scale per weight")
        if self.symmetric_activations:
            parts.append("signed symmetric activations")
        if self.reduce_range != "auto":
            parts.append("7-bit weights" if self.reduce_range else "8-bit weights even without VNNI")
        if self.smoothquant_alpha is not None:
            parts.append(f"on the SmoothQuant-smoothed model (alpha {self.smoothquant_alpha:g})")
        if self.rotation == "hadamard":
            parts.append("on the Hadamard-rotated model (residual stream; Pre-RMSNorm checkpoints)")
        elif self.rotation == "online":
            parts.append("every Linear's input Hadamard-rotated online (any placement)")
        elif self.rotation is not None:
            parts.append(f"every Linear's input Hadamard-rotated online inside each activation block of "
                         f"{self.block_size} (one MatMul per input; any placement)")
        if self.norm_inputs == "calibrated":
            parts.append("the norm outputs (q/k/v, gate/up, head inputs) with one calibrated scale per tensor")
        if self.weight_rounding == "gptq":
            parts.append("GPTQ rounding of the INT8 weights (calibrated)")
        if self.carriers == "fp32":
            parts.append("the MatMuls whose inputs carry a massive activation (probe) kept in FP32")
        elif self.carriers == "pertoken":
            parts.append("the MatMuls whose inputs carry a massive activation (probe) quantized per token")
        if self.excluded:
            parts.append(f"{len(self.excluded)} node pattern(s) kept in FP32")
        return ", ".join(parts)


def _static(name: str, calibration: str, *, per_channel: bool = True, op_scope: str = "matmul",
            symmetric_activations: bool = False, **kw) -> Recipe:
    return Recipe(name, "static", calibration, per_channel, op_scope, symmetric_activations, "auto", **kw)


# Weight-only names: [rotated-|online-rotated-|block-rotated-|stream-block-rotated-]wo-int{4,8}-b<block>
# [-asym][-acc4][-gptq|-hqq][-fphead]
# (-asym: a zero point per block; -acc4: accuracy_level 4, int8 activations; -fphead: the LM head
# kept float32). The registry
# lists the useful points of that grid; ``get_recipe`` builds any other name of the form.
WEIGHT_ONLY_NAME = re.compile(r"(?P<rot>rotated-|online-rotated-|block-rotated-|stream-block-rotated-)?"
                              r"wo-int(?P<bits>\d+)-b(?P<block>\d+)"
                              r"(?P<asym>-asym)?(?P<acc>-acc4)?(?P<rounding>-gptq|-hqq)?(?P<head>-fphead)?")


def weight_only(name: str) -> Recipe:
    """The weight-only recipe a name of ``WEIGHT_ONLY_NAME``'s form says (ConfigError otherwise)."""
    m = WEIGHT_ONLY_NAME.fullmatch(name)
    if m is None:
        raise ConfigError(f"{name!r} is not a weight-only recipe name ([rotated-|online-rotated-|block-rotated-|"
                          "stream-block-rotated-]wo-int<4|8>-b<block>"
                          "[-asym][-acc4][-gptq|-hqq][-fphead])")
    rotation = {None: None, "rotated-": "hadamard", "online-rotated-": "online",
                "block-rotated-": f"{BLOCK_ROTATION}{m['block']}",
                "stream-block-rotated-": f"{STREAM_BLOCK_ROTATION}{m['block']}"}[m["rot"]]
    rounding = (m["rounding"] or "-nearest")[1:]
    return Recipe(name, "weight-only", None, True, "matmul", False, False, rotation=rotation,
                  weight_bits=int(m["bits"]), block_size=int(m["block"]), accuracy_level=4 if m["acc"] else 0,
                  weight_rounding=rounding, quantize_head=m["head"] is None, weight_symmetric=m["asym"] is None)


_WEIGHT_ONLY_LIST = [
    # Round-to-nearest (ORT's own quantizer), 8 and 4 bits, blocks of 32 and 128, each at
    # accuracy_level 0 (float activations) and 4 (int8 activations per block: ORT GenAI's CPU default).
    "wo-int8-b32", "wo-int8-b32-acc4", "wo-int8-b128", "wo-int8-b128-acc4",
    "wo-int4-b32", "wo-int4-b32-acc4", "wo-int4-b128", "wo-int4-b128-acc4",
    # GPTQ rounding on the same grid (ours: quantize/weight_only.py), where rounding matters: 4 bits.
    "wo-int8-b128-gptq", "wo-int4-b32-gptq", "wo-int4-b32-acc4-gptq", "wo-int4-b128-gptq", "wo-int4-b128-acc4-gptq",
    # HQQ (ORT's quantizer; 4 bits, float activations only).
    "wo-int4-b32-hqq", "wo-int4-b128-hqq",
    # Asymmetric 4-bit codes (a zero point per block, as llama.cpp's Q4_1 and ORT's quantizer's default).
    "wo-int4-b32-asym", "wo-int4-b32-asym-acc4", "wo-int4-b128-asym",
    # The LM head kept float32: the largest matrix of a small model, and the one int4 hurts most.
    "wo-int4-b32-fphead", "wo-int4-b128-fphead",
    # The rotations: does spreading a massive activation over the block save accuracy_level 4?
    "rotated-wo-int4-b32", "rotated-wo-int4-b32-acc4", "rotated-wo-int8-b128-acc4",
    "online-rotated-wo-int4-b32", "online-rotated-wo-int4-b32-acc4", "online-rotated-wo-int8-b128-acc4",
    # Blocks of 128 run MLAS's int8 kernel with a quarter of the block scales to apply, but int8
    # activations per block of 128 lose accuracy on an unrotated stream; the stream rotation (with
    # GPTQ codes) gives it back on Pre-RMSNorm checkpoints (reports/vs-llamacpp/smollm2).
    "rotated-wo-int8-b128-acc4-gptq",
    # A Hadamard inside each activation block (any placement; blocks that divide every input width):
    # the most accurate 8-bit rows measured (reports/vs-llamacpp, KL 0.0011 on SmolLM2 in blocks of
    # 64, 0.0010 on Gemma 3 in blocks of 128). On a Pre-RMSNorm checkpoint the stream form runs a
    # third of its online operators in a step: 4-11% more generation tokens/s at KL 0.0017 (SmolLM2).
    "block-rotated-wo-int8-b64-acc4-gptq", "stream-block-rotated-wo-int8-b64-acc4-gptq",
]

_RECIPE_LIST = [
    # The baseline: W8A8 static QDQ on the weight MatMuls, per-channel weights, MinMax ranges.
    _static("static-minmax-matmul", "minmax"),
    # Per-tensor weights: the published W8A8 reference setting, the most outlier-sensitive one.
    _static("static-minmax-matmul-pertensor", "minmax", per_channel=False),
    # Histogram calibrations that clip outliers instead of covering them.
    _static("static-entropy-matmul", "entropy"),
    _static("static-percentile-matmul", "percentile"),
    _static("static-distribution-matmul", "distribution"),
    # MinMax over every token but the sink (position 0): the massive first-token values are
    # clipped, every other token gets a fine step (sink-aware calibration, PrefixQuant's question).
    _static("static-minmax-matmul-nosink", "minmax-nosink"),
    # The same with the MatMuls whose inputs carry a massive activation (found by the graph probe
    # on calibration windows) kept in FP32, or quantized per token: the probe chooses the exceptions.
    _static("static-minmax-matmul-carriers-fp32", "minmax", carriers="fp32"),
    _static("static-minmax-matmul-carriers-pertoken", "minmax", carriers="pertoken"),
    # ORT's default op list: also Add/Mul/Where/Softmax/Gather... (where -inf masks bite).
    _static("static-minmax-all", "minmax", op_scope="all"),
    # Signed symmetric activations (zero point 0), as TensorRT-style INT8 wants.
    _static("static-minmax-matmul-symact", "minmax", symmetric_activations=True),
    # Weights INT8 offline, activations quantized per batch at run time (MatMulInteger).
    Recipe("dynamic", "dynamic", None, True, "matmul", False, "auto"),
    # Activations quantized per token at run time (standard ONNX ops): one massive token no longer
    # sets the step of every other token (quantize/pertoken.py).
    Recipe("pertoken", "pertoken", None, True, "matmul", False, "auto"),
    # The same on the Hadamard-rotated model (QuaRot-style; Pre-RMSNorm checkpoints, hf/rotation.py).
    Recipe("rotated-pertoken", "pertoken", None, True, "matmul", False, "auto", rotation="hadamard"),
    # The same two with ONNX Runtime's fused MatMulIntegerToFloat (rescale inside the GEMM).
    Recipe("pertoken-fused", "pertoken", None, True, "matmul", False, "auto", pertoken_kernel="ort-fused"),
    Recipe("rotated-pertoken-fused", "pertoken", None, True, "matmul", False, "auto", rotation="hadamard",
           pertoken_kernel="ort-fused"),
    # Every Linear's input rotated online (exact for any placement, Peri-LN included).
    Recipe("online-rotated-pertoken-fused", "pertoken", None, True, "matmul", False, "auto", rotation="online",
           pertoken_kernel="ort-fused"),
    # The per-token recipes with GPTQ rounding of the weights instead of round-to-nearest.
    Recipe("pertoken-fused-gptq", "pertoken", None, True, "matmul", False, "auto", pertoken_kernel="ort-fused",
           weight_rounding="gptq"),
    Recipe("rotated-pertoken-fused-gptq", "pertoken", None, True, "matmul", False, "auto", rotation="hadamard",
           pertoken_kernel="ort-fused", weight_rounding="gptq"),
    Recipe("online-rotated-pertoken-fused-gptq", "pertoken", None, True, "matmul", False, "auto", rotation="online",
           pertoken_kernel="ort-fused", weight_rounding="gptq"),
    # The stream rotation with per-token scales only where rows differ (the o- and down-projection
    # inputs) and one calibrated scale for the norm outputs, whose rows the fold and the rotation
    # make alike: the fast path of ORT's integer GEMM for five of the seven Linears of a block.
    Recipe("rotated-pertoken-fused-calnorm", "pertoken", None, True, "matmul", False, "auto", rotation="hadamard",
           pertoken_kernel="ort-fused", norm_inputs="calibrated"),
    Recipe("rotated-pertoken-fused-calnorm-gptq", "pertoken", None, True, "matmul", False, "auto",
           rotation="hadamard", pertoken_kernel="ort-fused", norm_inputs="calibrated", weight_rounding="gptq"),
    # The baseline on the SmoothQuant-smoothed FP32 model (outliers moved into the weights).
    _static("smoothquant", "minmax", smoothquant_alpha=0.5),
    # Not INT8: the float16 variant GPUs run, beside the INT8 recipes on the same windows.
    Recipe("fp16", "fp16", None, False, "all", False, False),
    # Weight-only: what users deploy instead of W8A8 (see WEIGHT_ONLY_NAME).
    *[weight_only(name) for name in _WEIGHT_ONLY_LIST],
]
RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPE_LIST}

# The set `evaluate` runs by default. Evidence (2-layer d64 models, 300 steps on builtin:pydoc,
# 48 evaluation windows of 64 bytes, 32 calibration windows, ORT 1.31 on a VNNI CPU; KL mean vs
# FP32 for pre/rms | post/layer): minmax-matmul 0.00039 | 0.00046, pertensor 0.00042 | 0.00047,
# entropy 0.00038 | 0.00044, percentile 0.00040 | 0.00044, distribution 0.00044 | 0.00056,
# symact 0.00046 | 0.00058, minmax-all 0.00335 | 0.01406, dynamic 0.00010 | 0.00010.
DEFAULT_RECIPES: tuple[str, ...] = (
    "static-minmax-matmul",            # the baseline W8A8 the others are read against
    "static-minmax-matmul-pertensor",  # one scale per weight (the published W8A8 setting): most outlier-sensitive
    "static-entropy-matmul",           # KL-optimal clipping (TensorRT's method); differs from minmax on outliers
    "static-percentile-matmul",        # percentile clipping: the other common outlier remedy
    "static-minmax-all",               # ORT's default op list: 8-30x the KL of matmul scope, where norms bite
    "dynamic",                         # no calibration: the easy deployment path, and the most accurate
)
# Left out of the default set: static-distribution-matmul (for INT8 ORT uses the symmetric range
# [-max|x|, max|x|], a MinMax variant), static-minmax-matmul-symact (within noise of the baseline).

# The set `evaluate` runs instead when no --recipes are named and the FP32 probe finds massive
# activations: every per-tensor recipe above spends its 8 bits on them. Evidence (reports/real-models,
# 8,192 tokens; KL mean, top-1 for SmolLM2-135M | Gemma 3 270M): static-minmax-matmul 0.81, 55% |
# 0.33, 72%; dynamic 0.62, 60% | 0.16, 80%; pertoken-fused 0.062, 87% | 0.046, 89%; wo-int8-b32-acc4
# 0.0053, 95.5% | 0.0032, 97.0%; online-rotated-pertoken-fused-gptq 0.0022, 97.3% | 0.0018, 97.9%.
MASSIVE_DEFAULT_RECIPES: tuple[str, ...] = (
    "pertoken-fused",                      # W8A8 with a scale per token: the cheapest that keeps the model usable
    "wo-int8-b32-acc4",                    # weight-only int8 with int8 block activations (what ORT GenAI ships)
    "online-rotated-pertoken-fused-gptq",  # Hadamard-rotated W8A8 with GPTQ: the most accurate W8A8 on both
)


ALPHA_SEPARATOR = "@"   # smoothquant@0.7: a SmoothQuant recipe at another migration strength
# <recipe>-emb8: that recipe with the token embedding in int8 blocks (Recipe.embedding_bits)
EMBEDDING_SUFFIX = "-emb8"


def get_recipe(name: str) -> Recipe:
    """The registry's recipe; ``<smoothquant recipe>@ALPHA`` is that recipe at migration strength
    ALPHA in [0, 1] (so a search space or a recipe list can hold several alphas side by side)."""
    if name.endswith(EMBEDDING_SUFFIX) and len(name) > len(EMBEDDING_SUFFIX):
        recipe = get_recipe(name.removesuffix(EMBEDDING_SUFFIX))
        if recipe.mode == "fp16" or recipe.embedding_bits:
            raise ConfigError(f"recipe {name!r}: {EMBEDDING_SUFFIX} quantizes the embedding of an integer recipe "
                              f"once ({recipe.name} is {'fp16' if recipe.mode == 'fp16' else 'one already'})")
        return replace(recipe, name=recipe.name + EMBEDDING_SUFFIX, embedding_bits=8)
    base, sep, alpha = name.partition(ALPHA_SEPARATOR)
    try:
        recipe = RECIPES[base] if base in RECIPES or not WEIGHT_ONLY_NAME.fullmatch(base) else weight_only(base)
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}: choose one of {', '.join(RECIPES)} (SmoothQuant recipes also "
                          f"as NAME{ALPHA_SEPARATOR}ALPHA, e.g. smoothquant{ALPHA_SEPARATOR}0.7; weight-only ones "
                          "as [rotated-|online-rotated-|block-rotated-|stream-block-rotated-]wo-int<4|8>-b<block>"
                          "[-asym][-acc4][-gptq|-hqq][-fphead]; any "
                          f"integer recipe with its token embedding in int8 as NAME{EMBEDDING_SUFFIX})") from None
    if not sep:
        return recipe
    if recipe.smoothquant_alpha is None:
        raise ConfigError(f"recipe {name!r}: only SmoothQuant recipes take {ALPHA_SEPARATOR}ALPHA ({base} is not one)")
    try:
        value = float(alpha)
    except ValueError:
        raise ConfigError(f"recipe {name!r}: {alpha!r} is not a number (give e.g. {base}{ALPHA_SEPARATOR}0.7)") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"recipe {name!r}: the SmoothQuant alpha must be in [0, 1], got {value:g}")
    return replace(recipe, name=f"{base}{ALPHA_SEPARATOR}{value:g}", smoothquant_alpha=value)


def with_exclusions(recipe: Recipe, patterns, name: str | None = None) -> Recipe:
    """Mixed precision: ``recipe`` with ``patterns`` (node names or fnmatch patterns such as
    ``head/*`` or ``blocks.*.mlp.down/*``) also kept in FP32.

    The new recipe gets its own name (default ``<recipe>-mixed-<6 hex of the patterns>``, safe in
    a file name), so two variants of one recipe never share an ONNX file or a results entry.
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    patterns = tuple(dict.fromkeys(str(p).strip() for p in patterns))
    if not patterns or not all(patterns):
        raise ConfigError("give at least one non-empty node name or pattern to exclude")
    excluded = recipe.excluded + tuple(p for p in patterns if p not in recipe.excluded)
    if name is None:
        digest = hashlib.sha1("\n".join(excluded).encode()).hexdigest()[:6]
        name = f"{recipe.name.split('-mixed-')[0]}-mixed-{digest}"
    return replace(recipe, name=name, excluded=excluded)
