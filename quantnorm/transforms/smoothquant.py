"""SmoothQuant, placement-aware: move activation outliers into the weights, for free where the
placement allows it and with an explicit per-channel scale where it does not.

SmoothQuant (Xiao et al. 2022, arXiv 2211.10438; shared FORMULAS.md): for the input X of a
weight MatMul ``y = X W^T`` and each input channel j,

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

with ``max|X_j|`` over the calibration windows (never the evaluation range) and ``max|W_j|`` over
the output rows of W. Then ``y = (X / s) (W * s)^T`` exactly: the activation's outlier channels
shrink by s_j, the weight columns grow by s_j, and INT8 ranges suit both better. Linears that
read one and the same tensor (q, k and v) get one s from the max over all their weights, since
the shared input can only be divided once. s is clamped to [1e-5, 1e5]; a channel whose max|X|
or max|W| is 0 gets s = 1 (dividing by it would give inf or 0 and there is nothing to balance).

Where ``X / s`` goes is the placement-dependent part, decided by one rule on the model's own
dataflow (not by the placement's name):

    FOLD when X is the output of a norm and every consumer of that output is one of the
    Linears in the group. Then ``norm.weight /= s`` (and ``norm.bias /= s`` for LayerNorm)
    produces X / s directly: no extra op, no runtime cost.
    Otherwise insert an EXPLICIT scale: the Linear computes ``(x * (1/s)) W'^T``, one ONNX
    ``Mul`` before the MatMul (q, k and v share it), which costs a little latency.

"Every consumer" is read from the autograd graph of one forward pass: the norm output's
autograd node must have exactly as many consumers as the group has Linears. A norm whose output
is also the residual stream (post, deepnorm: ``x = N(x + F(x))`` feeds the next sublayer *and*
its skip; residual: ``x_a``) has an extra consumer (the skip's Add), so folding would rescale
the stream itself. Inputs that are no norm output at all (``mlp.down`` after GELU, ``attn.proj``
after attention, ResiDual's head input ``x_a + N(x_d)``, block 0 of post/deepnorm/residual
reading the embedding) are explicit too. What the rule gives, L blocks:

| placement | folded (no runtime cost)                                | explicit scale (a Mul each)                 |
|-----------|---------------------------------------------------------|---------------------------------------------|
| pre       | q, k, v, mlp.up (input norms); head (final norm)        | attn.proj, mlp.down                          |
| peri      | q, k, v, mlp.up (norm_in); head (final norm)            | attn.proj, mlp.down                          |
| post      | head (the last block's MLP norm feeds only the head)    | q, k, v, mlp.up, attn.proj, mlp.down         |
| deepnorm  | head (likewise)                                         | q, k, v, mlp.up, attn.proj, mlp.down         |
| residual  | none (the head reads x_a + N(x_d), an Add)              | everything                                   |

The post/deepnorm head fold is real, not a loophole: after the last block nothing but the head
reads the stream, so the last norm's weight can carry 1/s.

    smoothed, plan = smooth_model(model, calib_inputs, alpha=0.5)   # model itself is untouched
    plan.to_dict()   # the ``smoothquant`` section of results.json

``smooth_model`` checks that the smoothed model computes the original logits (a
``QuantizeError`` if not); ``export_smoothed`` exports it with ``export_onnx``'s own parity
check and also compares the ONNX logits with the *original* model's.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, QuantizeError
from ..export import export_onnx, torch_outputs
from ..measure.latency import bench_model
from ..models import CausalLM
from ..models.norms import NORMS
from ..module_export import check_matches_original, export_matching_original, max_output_diff
from .variants import FP32Variants

SCALE_MIN = 1e-5
SCALE_MAX = 1e5
DEFAULT_ALPHA = 0.5
# Smoothing is exact algebra; what is left is float32 rounding of W*s and of norm weights / s.
DEFAULT_PARITY_TOLERANCE = 1e-3
LATENCY_BATCH = 8  # a serving batch: large enough that the GEMMs, which smoothing changes, dominate


class SmoothedLinear(nn.Linear):
    """``y = (x * smooth_inv) W^T + b``: a Linear with an explicit per-input-channel scale.

    Used where 1/s cannot be folded into a norm. It keeps the module's name (so the ONNX nodes
    are still ``blocks.0.mlp.down/MatMul``, plus ``blocks.0.mlp.down/Mul``), and Linears of one
    group hold the *same* ``smooth_inv`` tensor, so the exporter emits one shared Mul for q/k/v.
    """

    def __init__(self, linear: nn.Linear, smooth_inv: torch.Tensor):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.register_buffer("smooth_inv", smooth_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.smooth_inv, self.weight, self.bias)


@dataclass(frozen=True)
class InputGroup:
    """Linears that read one tensor, where that tensor comes from, and whether 1/s can fold."""

    linears: tuple[str, ...]
    source: str | None   # the norm module whose output is the input, if any
    foldable: bool
    reason: str


@dataclass(frozen=True)
class SmoothQuantPlan:
    alpha: float
    scales: dict[str, np.ndarray]         # Linear module name -> s (float32, [in_features])
    folded: list[str]                     # Linears whose 1/s went into a norm
    explicit_scale: list[str]             # Linears with an explicit Mul before the MatMul
    placement: str = ""
    norm: str = ""
    groups: tuple[InputGroup, ...] = ()
    # per group (keyed by its first Linear): max|X_j| over channels / median over channels,
    # before and after smoothing (after = max|X_j| / s_j, exact)
    channel_ratio: dict[str, tuple[float, float]] = field(default_factory=dict)
    torch_max_abs_logit_diff: float | None = None
    strip_prefix: str = ""                # module-name prefix left out of what is shown (a wrapper's attribute)

    def _n(self, name: str | None) -> str | None:
        return name[len(self.strip_prefix):] if name and self.strip_prefix and name.startswith(self.strip_prefix) else name

    def folded_into(self) -> dict[str, str]:
        return {self._n(name): self._n(g.source) for g in self.groups if g.foldable for name in g.linears}

    def statement(self) -> str:
        """The deployment property in one sentence, per placement (for report and results.json)."""
        n = len(self.folded) + len(self.explicit_scale)
        text = (f"{self.placement}/{self.norm}: {len(self.folded)} of {n} weight MatMuls take SmoothQuant for free "
                f"(1/s folded into the norm that feeds only them)")
        if self.folded:
            text += f": {_collapse([self._n(x) for x in self.folded])}"
        text += f"; {len(self.explicit_scale)} need an explicit per-channel Mul"
        if self.explicit_scale:
            text += f": {_collapse([self._n(x) for x in self.explicit_scale])}"
        return text + "."

    def to_dict(self) -> dict:
        """The ``smoothquant`` section of results.json (RESULTS.md) plus the details behind it."""
        groups = []
        for g in self.groups:
            s = self.scales[g.linears[0]]
            before, after = self.channel_ratio.get(g.linears[0], (None, None))
            groups.append({
                "matmuls": [self._n(x) for x in g.linears], "kind": "folded" if g.foldable else "explicit_scale",
                "source": self._n(g.source), "reason": g.reason.replace(g.source, self._n(g.source)) if g.source else g.reason,
                "scale_min": float(s.min()), "scale_median": float(np.median(s)), "scale_max": float(s.max()),
                "channel_ratio_before": before, "channel_ratio_after": after,
            })
        return {
            "alpha": self.alpha,
            "folded": [self._n(x) for x in self.folded],
            "explicit_scale": [self._n(x) for x in self.explicit_scale],
            "folded_into": self.folded_into(),
            "placement": self.placement,
            "norm": self.norm,
            "statement": self.statement(),
            "groups": groups,
            "torch_max_abs_logit_diff": self.torch_max_abs_logit_diff,
        }


def _collapse(names: list[str]) -> str:
    """``blocks.0.attn.q, blocks.1.attn.q`` -> ``blocks.*.attn.q (x2)``: readable for L blocks
    (any ``.N.`` block index: ``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``)."""
    counts = Counter(re.sub(r"(^|\.)\d+\.", r"\1*.", n) for n in names)
    return ", ".join(f"{k} (x{c})" if c > 1 else k for k, c in counts.items())


# ---------------------------------------------------------------------------------------------
# Structure: which Linears share an input, and may their 1/s be folded into a norm?


def _norm_types() -> tuple[type[nn.Module], ...]:
    return tuple(NORMS.values())


def input_groups(model: nn.Module, example_ids: torch.Tensor, *,
                 is_norm: Callable[[nn.Module], bool] | None = None) -> list[InputGroup]:
    """Group the model's Linears by the tensor they read and apply the fold rule (module doc).

    ``model(example_ids)`` returns logits (or a tuple of outputs: an encoder wrapper);
    ``is_norm`` says which modules are norms (default: the zoo's norm classes). Runs one forward
    pass with autograd on (on a copy, so the caller's ``requires_grad`` flags and hooks are
    untouched): Linear inputs and norm outputs are matched by tensor identity and the consumers
    of a norm's output are counted in the autograd graph. A Linear may also read a *view* of a
    norm output that keeps the channel axis (Hugging Face heads read ``hidden[:, -k:, :]``): the
    fold is still exact when the view is the norm output's only consumer.
    """
    is_norm = is_norm or (lambda m: isinstance(m, _norm_types()))
    probe = copy.deepcopy(model).eval()
    probe.requires_grad_(True)
    linear_inputs: dict[str, torch.Tensor] = {}
    norm_outputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in probe.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: linear_inputs.__setitem__(name, args[0])))
        elif is_norm(module):
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: norm_outputs.__setitem__(name, out)))
    try:
        with torch.enable_grad():
            outputs = probe(example_ids)
    finally:
        for h in handles:
            h.remove()
    consumers = _autograd_consumers(outputs if isinstance(outputs, (tuple, list)) else (outputs,))

    groups: list[list[str]] = []
    for name, x in linear_inputs.items():  # forward order: q, k, v, proj, up, down, ..., head
        for group in groups:
            if linear_inputs[group[0]] is x:
                group.append(name)
                break
        else:
            groups.append([name])

    def users(t: torch.Tensor) -> int:
        return consumers.get(t.grad_fn, 0) if t.grad_fn is not None else 0

    out = []
    for names in groups:
        x = linear_inputs[names[0]]
        source = next((n for n, y in norm_outputs.items() if y is x), None)
        via_view = None
        if source is None:
            via_view = next((n for n, y in norm_outputs.items() if isinstance(y, torch.Tensor) and x._base is y
                             and x.shape[-1] == y.shape[-1] and x.stride(-1) == y.stride(-1)), None)
        if source is None and via_view is None:
            out.append(InputGroup(tuple(names), None, False, "input is not a norm output"))
            continue
        if via_view is not None:
            y = norm_outputs[via_view]
            if users(y) == 1 and users(x) == len(names):
                out.append(InputGroup(tuple(names), via_view, True,
                                      f"{via_view} feeds only these MatMuls (through a slice)"))
            else:
                out.append(InputGroup(tuple(names), via_view, False,
                                      f"{via_view} also feeds {users(y) - 1} other op(s) (the residual stream)"))
            continue
        n_users = users(x)
        if n_users == len(names):
            out.append(InputGroup(tuple(names), source, True, f"{source} feeds only these MatMuls"))
        else:
            out.append(InputGroup(tuple(names), source, False,
                                  f"{source} also feeds {n_users - len(names)} other op(s) (the residual stream)"))
    return out


def _autograd_consumers(outputs) -> Counter:
    """How many graph edges point at each autograd node reachable from ``outputs``."""
    counts: Counter = Counter()
    seen = set()
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                counts[nxt] += 1
                stack.append(nxt)
    return counts


# ---------------------------------------------------------------------------------------------
# Statistics and scales


def _batches(inputs: np.ndarray, batch_size: int):
    for lo in range(0, len(inputs), batch_size):
        yield torch.from_numpy(np.ascontiguousarray(inputs[lo:lo + batch_size], dtype=np.int64))


def linear_input_absmax(model: nn.Module, inputs: np.ndarray, names: list[str] | None = None, *,
                        batch_size: int = 16) -> dict[str, np.ndarray]:
    """max|X_j| per input channel of each named Linear over ``inputs`` (forward pre-hooks).

    For a ``SmoothedLinear`` this is the tensor its MatMul really multiplies, ``x * smooth_inv``.
    """
    modules = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = list(modules) if names is None else names
    amax: dict[str, torch.Tensor] = {}

    def hook(module, args, name):
        x = args[0].detach()
        if isinstance(module, SmoothedLinear):
            x = x * module.smooth_inv
        m = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        amax[name] = m if name not in amax else torch.maximum(amax[name], m)

    handles = [modules[n].register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n)) for n in names]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in _batches(inputs, batch_size):
                model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: amax[n].cpu().numpy() for n in names}


def smoothing_scales(x_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), clamped to [SCALE_MIN, SCALE_MAX]; 1 where
    either max is 0 or not finite (no information to balance, and no division by zero)."""
    x = np.asarray(x_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    ok = (x > 0) & (w > 0) & np.isfinite(x) & np.isfinite(w)
    s = np.ones_like(x)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return np.clip(s, SCALE_MIN, SCALE_MAX).astype(np.float32)


def _channel_ratio(amax: np.ndarray) -> float | None:
    median = float(np.median(amax))
    return float(amax.max() / median) if median > 0 else None


# ---------------------------------------------------------------------------------------------
# The transformation


def divide_norm_affine(norm: nn.Module, s: torch.Tensor) -> None:
    """Fold 1/s into ``w * x_hat (+ b)``: ``w /= s`` and ``b /= s`` (LayerNorm, RMSNorm)."""
    norm.weight.div_(s.to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(s.to(norm.bias.dtype))


def divide_norm_one_plus(norm: nn.Module, s: torch.Tensor) -> None:
    """Fold 1/s into Gemma's ``(1 + w) * x_hat``: ``1 + w' = (1 + w) / s``, i.e. ``w' = (1 + w) / s - 1``."""
    w = norm.weight
    w.copy_(((1.0 + w.double()) / s.double() - 1.0).to(w.dtype))


def smooth_model(model: CausalLM, calib_inputs: np.ndarray, alpha: float = DEFAULT_ALPHA, *,
                 batch_size: int = 16, parity_windows: int = 4,
                 parity_tolerance: float = DEFAULT_PARITY_TOLERANCE) -> tuple[CausalLM, SmoothQuantPlan]:
    """A smoothed deep copy of a zoo ``model`` and the plan that says what was done where.

    ``calib_inputs``: int64 token windows [n, seq] from the calibration range. The copy must
    compute the same logits as ``model`` on the first ``parity_windows`` of them (max |delta
    logit| <= ``parity_tolerance``), else ``QuantizeError``.
    """
    calib_inputs = np.asarray(calib_inputs)
    if calib_inputs.ndim == 2 and calib_inputs.shape[1] > model.cfg.context:
        raise ConfigError(f"calibration windows of {calib_inputs.shape[1]} tokens exceed the context {model.cfg.context}")
    return smooth_module(model, calib_inputs, alpha, placement=model.cfg.placement, norm=model.cfg.norm,
                         batch_size=batch_size, parity_windows=parity_windows, parity_tolerance=parity_tolerance)


def smooth_module(model: nn.Module, calib_inputs: np.ndarray, alpha: float = DEFAULT_ALPHA, *,
                  placement: str = "", norm: str = "",
                  is_norm: Callable[[nn.Module], bool] | None = None,
                  fold: Callable[[nn.Module, torch.Tensor], None] = divide_norm_affine,
                  batch_size: int = 16, parity_windows: int = 4,
                  parity_tolerance: float = DEFAULT_PARITY_TOLERANCE,
                  relative_parity: bool = False, strip_prefix: str = "") -> tuple[nn.Module, SmoothQuantPlan]:
    """SmoothQuant any module whose ``forward(ids)`` returns logits or a tuple of outputs (the
    zoo's models; the Hugging Face wrappers of ``quantnorm.sources.hf_export``).

    ``is_norm``: which modules are norms (default: the zoo's); ``fold(norm, s)``: how 1/s goes
    into a norm's parameters (``divide_norm_affine``; Gemma's ``(1 + w)`` norms need
    ``divide_norm_one_plus``). Every smoothed Linear gets its own copy of its weight, so a head
    tied to the token embedding is untied rather than scaling the embedding too. Parity: every
    output within ``parity_tolerance`` of the original's (times ``max(1, max |reference|)`` when
    ``relative_parity``: real checkpoints' outputs reach tens), else ``QuantizeError``.
    """
    if not 0.0 <= float(alpha) <= 1.0:
        raise ConfigError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    calib_inputs = np.asarray(calib_inputs)
    if calib_inputs.ndim != 2 or len(calib_inputs) == 0 or not np.issubdtype(calib_inputs.dtype, np.integer):
        raise ConfigError(f"SmoothQuant needs calibration token windows [n, seq] (int), got shape {calib_inputs.shape}")

    example = torch.from_numpy(np.ascontiguousarray(calib_inputs[:1], dtype=np.int64))
    groups = input_groups(model, example) if is_norm is None else input_groups(model, example, is_norm=is_norm)
    names = [g.linears[0] for g in groups]  # all Linears of a group read the same tensor
    x_absmax = linear_input_absmax(model, calib_inputs, names, batch_size=batch_size)

    smoothed = copy.deepcopy(model).eval()
    modules = dict(smoothed.named_modules())
    scales: dict[str, np.ndarray] = {}
    channel_ratio: dict[str, tuple[float | None, float | None]] = {}
    folded: list[str] = []
    explicit: list[str] = []
    with torch.no_grad():
        for g in groups:
            weights = [modules[n].weight.detach().float().abs() for n in g.linears]
            w_absmax = torch.stack([w.amax(dim=0) for w in weights]).amax(dim=0).cpu().numpy()
            s = smoothing_scales(x_absmax[g.linears[0]], w_absmax, float(alpha))
            channel_ratio[g.linears[0]] = (_channel_ratio(x_absmax[g.linears[0]]),
                                           _channel_ratio(x_absmax[g.linears[0]] / s))
            s_t = torch.from_numpy(s).to(next(smoothed.parameters()).device)
            for n in g.linears:
                scales[n] = s
                lin = modules[n]
                # untie (a head sharing the embedding's Parameter) before scaling the columns
                lin.weight = nn.Parameter(lin.weight.detach().clone() * s_t.to(lin.weight.dtype)[None, :],
                                          requires_grad=False)
            source = modules.get(g.source) if g.source else None
            if g.foldable and getattr(source, "weight", None) is not None:
                fold(source, s_t)
                folded += g.linears
            else:
                inv = (1.0 / s_t).to(modules[g.linears[0]].weight.dtype)  # one tensor: one shared Mul
                for n in g.linears:
                    _replace_module(smoothed, n, SmoothedLinear(modules[n], inv))
                explicit += g.linears

    diff = max_abs_logit_diff(model, smoothed, calib_inputs[:parity_windows], relative=relative_parity)
    if not diff <= parity_tolerance:  # also catches NaN
        raise QuantizeError(
            f"SmoothQuant changed the FP32 model: max |delta logit| = {diff:.3g} > {parity_tolerance:g} "
            f"(alpha {alpha}); the scales may be extreme (clamped to [{SCALE_MIN:g}, {SCALE_MAX:g}])"
        )
    plan = SmoothQuantPlan(
        alpha=float(alpha), scales=scales, folded=folded, explicit_scale=explicit,
        placement=placement, norm=norm, groups=tuple(groups),
        channel_ratio=channel_ratio, torch_max_abs_logit_diff=diff, strip_prefix=strip_prefix,
    )
    return smoothed, plan


def _replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def torch_logits(model: nn.Module, inputs: np.ndarray, batch_size: int = 16) -> np.ndarray:
    return torch_outputs(model, inputs, batch_size)[0]


def max_abs_logit_diff(a: nn.Module, b: nn.Module, inputs: np.ndarray, *, relative: bool = False) -> float:
    """max |a - b| over every output; with ``relative`` each output's is divided by
    ``max(1, max |a|)`` (the scale-aware gate of the Hugging Face export)."""
    return max_output_diff(torch_outputs(a, inputs), torch_outputs(b, inputs), relative=relative)


# ---------------------------------------------------------------------------------------------
# ONNX: export the smoothed model, and what the explicit scales cost


@dataclass(frozen=True)
class SmoothQuantExport:
    path: Path
    plan: SmoothQuantPlan
    export: object                      # quantnorm.export.ExportResult (parity vs the smoothed model)
    onnx_vs_original_max_abs_logit_diff: float
    model: CausalLM                     # the smoothed torch model

    def to_dict(self, run_dir: Path | None = None) -> dict:
        return {**self.plan.to_dict(), "path": Path(self.path).name,
                "export": self.export.to_dict(run_dir),
                "onnx_vs_original_max_abs_logit_diff": self.onnx_vs_original_max_abs_logit_diff}


def export_smoothed(model: CausalLM, calib_inputs: np.ndarray, parity_inputs: np.ndarray, out_path: Path, *,
                    alpha: float = DEFAULT_ALPHA, opset: int = 18,
                    parity_tolerance: float = DEFAULT_PARITY_TOLERANCE) -> SmoothQuantExport:
    """Smooth ``model`` and export it to ``out_path``: two parity checks guard the file.

    ``export_onnx`` checks the ONNX file against the smoothed torch model (its usual 1e-4);
    then the ONNX logits are compared with the *original* model's on ``parity_inputs`` (the
    check that matters: the INT8 model is judged against the original FP32 one). A failure
    removes the file and raises ``ExportError``.
    """
    smoothed, plan = smooth_model(model, calib_inputs, alpha, parity_tolerance=parity_tolerance)
    out_path = Path(out_path)
    exported = export_onnx(smoothed, out_path, parity_inputs, opset=opset)
    diff = check_matches_original(model, out_path, parity_inputs, what="smoothed", tolerance=parity_tolerance,
                                  relative=False, batch_size=16)
    return SmoothQuantExport(out_path, plan, exported, diff, smoothed)


def fp32_latency_cost(fp32_path: Path, smoothed_path: Path, spec, *, seq: int, batch: int = LATENCY_BATCH,
                      warmup: int = 3, iters: int = 30, rounds: int = 3) -> dict:
    """p50 latency of the smoothed FP32 model vs the original: what the explicit Muls cost.

    The two are timed in alternating rounds and the ratio is the median of the per-round ratios,
    so a neighbour's load drifting during the measurement shifts both sides alike.
    """
    per_round = max(3, iters // rounds)
    p50s: dict[str, list[float]] = {"fp32": [], "fp32_smoothquant": []}
    for _ in range(rounds):
        for variant, path in (("fp32", fp32_path), ("fp32_smoothquant", smoothed_path)):
            row = bench_model(path, variant=variant, spec=spec, batch=batch, seq=seq, warmup=warmup,
                              iters=per_round, record_placement=False)
            if not row.measured:
                return {"status": row.status, "batch": batch, "seq": seq, "provider": spec.provider}
            p50s[variant].append(row.p50_ms)
    ratios = [b / a for a, b in zip(p50s["fp32"], p50s["fp32_smoothquant"], strict=True)]
    return {
        "status": "measured", "provider": spec.provider, "batch": batch, "seq": seq, "rounds": rounds,
        "iters_per_round": per_round,
        "fp32_p50_ms": float(np.median(p50s["fp32"])),
        "fp32_smoothquant_p50_ms": float(np.median(p50s["fp32_smoothquant"])),
        "fp32_latency_ratio": float(np.median(ratios)),
    }


@dataclass(frozen=True)
class FoldRules:
    """What a source tells SmoothQuant about its model: the placement and norm (recorded in the
    plan), which modules are norms, how 1/s goes into one (``fold``, and its formula as recorded),
    and the name prefix its export drops from node names."""

    placement: str
    norm: str
    is_norm: Callable[[nn.Module], bool]
    fold: Callable[[nn.Module, torch.Tensor], None]
    formula: str
    strip_prefix: str = ""


@dataclass(frozen=True)
class SmoothedModuleExport:
    """A smoothed copy of any module (a checkpoint's export wrapper), exported with the parity gates."""

    path: Path
    plan: SmoothQuantPlan
    export: object                      # module_export.ModuleExportResult (parity vs the smoothed module)
    onnx_vs_original_max_abs_logit_diff: float   # relative to max(1, max |original output|)
    fold_formula: str

    def to_dict(self, run_dir: Path | None = None) -> dict:
        return {**self.plan.to_dict(), "path": Path(self.path).name, "export": self.export.to_dict(run_dir),
                "onnx_vs_original_max_abs_logit_diff": self.onnx_vs_original_max_abs_logit_diff,
                "parity_rule": "max |delta| / max(1, max |original|) per output, max over outputs",
                "fold_formula": self.fold_formula}


def smooth_by_rules(wrapper, rules: FoldRules, calib_inputs: np.ndarray, alpha: float,
                    tolerance: float = DEFAULT_PARITY_TOLERANCE):
    """(a smoothed deep copy of ``wrapper`` by the source's fold ``rules``, its plan)."""
    return smooth_module(wrapper, calib_inputs, alpha, placement=rules.placement, norm=rules.norm,
                         is_norm=rules.is_norm, fold=rules.fold, batch_size=8, parity_tolerance=tolerance,
                         relative_parity=True, strip_prefix=rules.strip_prefix)  # names as the ONNX nodes carry them


def smooth_and_export(wrapper, rules: FoldRules, calib_inputs: np.ndarray, parity_inputs: np.ndarray,
                      out_path: Path, *, alpha: float, outputs: tuple[str, ...], max_positions: int | None,
                      opset: int, tolerance: float = DEFAULT_PARITY_TOLERANCE) -> SmoothedModuleExport:
    """Smooth ``wrapper`` (a deep copy; the original is untouched) by the source's fold ``rules``,
    export it and prove that the ONNX file computes the original outputs. A failure leaves no file."""
    smoothed, plan = smooth_by_rules(wrapper, rules, calib_inputs, alpha, tolerance)
    exported, diff = export_matching_original(smoothed, wrapper, out_path, parity_inputs, what="smoothed",
                                              outputs=outputs, max_positions=max_positions, opset=opset,
                                              tolerance=tolerance)
    return SmoothedModuleExport(Path(out_path), plan, exported, diff, rules.formula)


def smoothing(model: CausalLM, calib_inputs: np.ndarray, parity_inputs: np.ndarray, *, opset: int = 18) -> Callable:
    """``smooth(alpha, path)`` for ``FP32Variants``: a zoo model's smoothed export."""
    def smooth(alpha: float, path: Path) -> SmoothQuantExport:
        return export_smoothed(model, calib_inputs, parity_inputs, path, alpha=alpha, opset=opset)
    return smooth


class SmoothedModels(FP32Variants):
    """A zoo model's smoothed FP32 exports, one per alpha, made on first use (no rotated export)."""

    def __init__(self, model: CausalLM, calib_inputs: np.ndarray, parity_inputs: np.ndarray, out_dir: Path,
                 *, opset: int = 18):
        super().__init__(out_dir, smooth=smoothing(model, calib_inputs, parity_inputs, opset=opset))
