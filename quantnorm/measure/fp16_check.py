"""Does the checkpoint survive float16? Which tensors overflow, and what the usual fixes cost.

ONNX Runtime's CPU provider computes float16 ops in float32 (PITFALLS.md 13: an fp16 Add of
40,000 + 40,000 returns 80,000), so an fp16 ONNX graph run here cannot show an overflow. The
check is decided from what really overflows:

1. the FP32 forward's ranges: every module output and every block output (the residual stream),
   per token, against float16's largest finite value 65,504;
2. a torch float16 forward of the same model on the same windows (outputs rounded to float16, so
   a value past 65,504 becomes inf and spreads): its logits against the FP32 logits;
3. the fixes people ship, each measured the same way: the residual stream clipped to +-32,752
   after every block (what the community ONNX export of Gemma 3 270M does on its residual Adds);
   float16 compute with the residual stream kept in float32 (torch's autocast: every Linear,
   attention product and sublayer output in float16, the residual additions between blocks in
   float32, as mixed-precision deployments keep the stream); and a bfloat16 forward (float32's
   range, 8 bits of mantissa).

Accuracy figures are next-token PPL ratio, mean KL and top-1 agreement against the FP32 model on
the check's windows; a forward with a non-finite logit is "overflows" with the share of them.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ..feeds import window_feeder
from .accuracy import PairLadder
from .sessions import CPU

FP16_MAX = float(np.finfo(np.float16).max)  # 65504: float16's largest finite value
FP16_CHECK_WINDOWS = 4  # torch float16 on a CPU is slow; the overflow shows on any window with BOS
CLIP_VALUE = 32752.0  # the community Gemma 3 270M ONNX export's residual clip
MAX_LISTED = 12
FP32_RESIDUAL = "float16 compute, float32 residual stream"


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def fp32_overflow_scan(model, layers, inputs) -> list[dict]:
    """Module and block outputs of the FP32 forward with |a| > 65,504: name, max |a|, how many
    (window, token) rows overflow and the first positions."""
    import torch

    found: dict[str, dict] = {}
    block_names = {id(b): f"block {i} output (residual stream)" for i, b in enumerate(layers)}
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def hook(mod, args, out):
        t = _first(out)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2:
            return
        a = t.detach().abs().float()
        peak = float(a.max())
        if not peak > FP16_MAX:
            return
        rows = (a > FP16_MAX).reshape(-1, a.shape[-1]).any(dim=-1) if a.dim() >= 2 else a > FP16_MAX
        positions = (a > FP16_MAX).any(dim=-1).nonzero()[:, -1].tolist() if a.dim() >= 3 else []
        name = block_names.get(id(mod)) or names.get(mod, type(mod).__name__)
        entry = found.setdefault(name, {"tensor": name, "max_abs": 0.0, "rows_over": 0, "positions": set()})
        entry["max_abs"] = max(entry["max_abs"], peak)
        entry["rows_over"] += int(rows.sum())
        entry["positions"].update(int(p) for p in positions)

    for module in model.modules():
        if module is not model:
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for lo in range(0, len(inputs), 4):
                model(input_ids=torch.from_numpy(np.asarray(inputs[lo:lo + 4], dtype=np.int64)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = sorted(found.values(), key=lambda e: -e["max_abs"])
    for e in out:
        pos = sorted(e.pop("positions"))
        e["positions"] = pos[:8]
        e["n_positions"] = len(pos)
    return out


def _logits(model, inputs, dtype, clip: float | None = None, layers=None, autocast=None):
    """Logits of ``model`` (already cast to its dtype) on ``inputs``; ``clip``: the residual
    stream clamped after every block of ``layers``; ``autocast``: run under torch's CPU autocast
    to that dtype (an FP32 model: sublayers compute in it, the residual stream stays float32)."""
    import contextlib

    import torch

    handles = []
    if clip is not None:
        def clamp(mod, args, out):
            if isinstance(out, tuple):
                return (out[0].clamp(-clip, clip), *out[1:])
            return out.clamp(-clip, clip)
        handles = [b.register_forward_hook(clamp) for b in layers]
    mixed = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), mixed:
            parts = [model(input_ids=torch.from_numpy(np.asarray(inputs[lo:lo + 4], dtype=np.int64)),
                           use_cache=False).logits.float().numpy() for lo in range(0, len(inputs), 4)]
    finally:
        for h in handles:
            h.remove()
    del dtype
    return np.concatenate(parts)


def _compare(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict:
    finite = np.isfinite(got).all(axis=-1)
    share_bad = float(1.0 - finite.mean())
    out = {"nonfinite_positions": share_bad}
    if share_bad > 0:
        out["status"] = f"overflows: {100 * share_bad:.1f}% of positions have a non-finite logit"
        return out

    ladder = PairLadder()
    ladder.add(ref, got, targets)
    s = ladder.summary()
    out.update(status="ok", ppl_ratio=float(math.exp(s["mean_nll_int8"] - s["mean_nll_fp32"])),
               kld_mean=s["kld_mean"], top1_agreement=float(s["top1_agreement"]))
    return out


def fp16_check(loaded, inputs: np.ndarray, targets: np.ndarray) -> dict:
    """results.json ``fp16``: the FP32 overflow scan, the float16 forward and the fixes."""
    import torch

    model, layers = loaded.model, loaded.layers
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    overflow = fp32_overflow_scan(model, layers, inputs)
    ref = _logits(model, inputs, torch.float32)
    variants: dict[str, dict] = {}
    for name, dtype, clip in (("float16", torch.float16, None), (f"float16 + residual clip +-{CLIP_VALUE:g}",
                                                                 torch.float16, CLIP_VALUE),
                              (FP32_RESIDUAL, None, None), ("bfloat16", torch.bfloat16, None)):
        low = copy.deepcopy(model).to(dtype) if dtype is not None else model
        low_layers = list(low.base_model.get_submodule(loaded.spec.layers))
        try:
            got = _logits(low, inputs, dtype, clip=clip, layers=low_layers,
                          autocast=torch.float16 if dtype is None else None)
            variants[name] = _compare(ref, got, targets)
        except RuntimeError as exc:  # an op without a CPU kernel for this dtype
            variants[name] = {"status": f"not measured: {' '.join(str(exc).split())[:160]}"}
        del low
    plain = variants["float16"]
    over = [e for e in overflow if e["tensor"].startswith("block")]
    if plain.get("status") == "ok" and not overflow:
        verdict = "survives float16: no tensor passes 65,504 in the FP32 run"
    elif plain.get("status") == "ok":
        verdict = (f"float16 runs with finite logits, but {len(overflow)} tensors pass 65,504 in the FP32 run "
                   "(values saturate or become inf inside the graph)")
    else:
        verdict = (f"does not survive float16: {plain.get('status')}; {len(overflow)} tensors pass 65,504 "
                   f"in the FP32 run ({len(over)} of them block outputs, the residual stream)")
    return {
        "verdict": verdict, "fp16_max": FP16_MAX, "n_windows": int(len(inputs)), "seq": int(inputs.shape[1]),
        "fp32_overflow": overflow[:MAX_LISTED], "fp32_overflow_total": len(overflow),
        "forwards": variants,
        "how": "torch forwards on the CPU (outputs rounded to each dtype, so overflow shows); the FP32 ranges are "
               "every module and block output of the FP32 forward; ONNX Runtime's CPU provider computes float16 "
               "in float32, so no fp16 ONNX graph is timed or scored here",
    }


def graph_fp16_range(fp32_path, window: np.ndarray, top: int = 5) -> dict:
    """Which float tensors of an FP32 ONNX graph pass float16's largest value on one window [1, seq].

    The graph-level twin of ``fp32_overflow_scan`` for any source (no torch module needed): every
    float tensor is exposed as an output of one CPU session without graph optimization (so each
    exists as written). On a GPU an RMSNorm whose square overflows gives finite but wrong numbers
    (x * rsqrt(inf) = 0), so this names the tensors before any GPU runs. A failure to run is
    recorded as "not measured: why", not raised: the check is a diagnosis.
    """
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(fp32_path))
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {vi.name for vi in inferred.graph.value_info if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    existing = {o.name for o in model.graph.output}
    names = [o for node in model.graph.node for o in node.output if o in floats and o not in existing]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    names += [o.name for o in model.graph.output[: len(existing)]
              if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=[CPU])
        values = session.run(names, window_feeder(session)(window))
    except Exception as exc:  # noqa: BLE001
        return {"status": f"not measured: {' '.join(str(exc).split())[:200]}"}
    peaks = {n: float(np.max(np.abs(v))) if v.size else 0.0 for n, v in zip(names, values)}
    # Attention masks built from float32's lowest value (Hugging Face's causal mask) are sentinels,
    # not activations: the conversion clips that constant to -65504 and the softmax still gives 0.
    sentinel = float(np.finfo(np.float32).max) / 2
    masks = [n for n, m in peaks.items() if m >= sentinel]
    real = {n: m for n, m in peaks.items() if m < sentinel or np.isnan(m)}
    over = sorted(((n, m) for n, m in real.items() if not m <= FP16_MAX), key=lambda item: -item[1])
    largest = max(real.items(), key=lambda item: item[1]) if real else (None, 0.0)
    return {"status": "measured", "windows": 1, "tensors": len(peaks), "fp16_max": FP16_MAX,
            "largest": {"tensor": largest[0], "max_abs": largest[1]}, "n_over": len(over),
            "over": [{"tensor": n, "max_abs": m} for n, m in over[:top]], "mask_sentinels": len(masks)}
