"""Massive activations and outliers of a Hugging Face model: the zoo's probe, HF-side.

The statistics are ``quantnorm.measure.outliers``'s (``TensorAccumulator``: top-3 |a| with
position and channel, median, ratio, kurtosis, inf-norm; ``find_massive``: Sun et al.'s test),
so a real checkpoint's figures read exactly like the zoo's. What differs is where the tensors come
from:

- residual stream: forward hooks on the model's blocks (the pre-hook of block 0 gives the
  embedding output, each block's output hook the stream after it). Not ``output_hidden_states``:
  in several HF models its last entry is taken *after* the final norm, which is not a block output;
- norm outputs: every LayerNorm / RMSNorm module (HF classes ``*LayerNorm``, ``*RMSNorm``);
  for post-norm models (BERT) also each norm's *input*, the residual sum ``x + F(x)`` before it is
  normalized, where post-LN models keep their large values (``norm_inputs``; massive entries
  there are listed with ``stream: "pre-norm sum"``);
- weight-MatMul inputs: every ``nn.Linear``'s input; Linears that read one tensor (q, k, v)
  form one row (``modules`` lists them);
- attention: ``output_attentions=True`` (eager attention). Causal LMs: mean probability on key 0
  (BOS) over heads, queries 1..T-1 and windows (query 0 can only see key 0). Encoders: over all
  queries, on key 0 ([CLS], ``bos_attention``) and on the last key ([SEP], ``sep_attention``).

Each top entry and massive entry also carries the token at its position (``token``), so
"position 0" reads as ``[CLS]`` or ``<s>``.
"""

from __future__ import annotations

import numpy as np

from ..errors import MeasureError
from ..measure.fake_quant import FakeQuantSqnr
from ..measure.outliers import (
    MASSIVE_ABS,
    MASSIVE_LIMIT,
    MASSIVE_RATIO,
    OUTLIER_FEATURE_ABS,
    TensorAccumulator,
    find_massive,
    first_births,
    largest_ratio_layer,
    summarize,
)


def _is_norm(module) -> bool:
    from torch import nn

    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith(("LayerNorm", "RMSNorm"))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def probe_hf(loaded, inputs: np.ndarray, *, batch_size: int = 8, keep_first_window: bool = True) -> tuple[dict, dict]:
    """Run ``inputs`` (windows [n, seq]) through the loaded checkpoint and measure every monitored
    tensor. Returns (the ``outliers`` section, {layer: |a| [seq, d] of the first window})."""
    import torch
    from torch import nn

    windows = np.asarray(inputs, dtype=np.int64)
    if windows.ndim != 2 or len(windows) == 0:
        raise MeasureError(f"probe inputs must be windows [n, seq], got shape {windows.shape}")
    model, spec = loaded.model, loaded.spec
    kind = spec.kind
    accs: dict[tuple[str, str], TensorAccumulator] = {}
    modules_of: dict[str, list[str]] = {}
    massive: list[dict] = []
    first_window: dict = {}
    state = {"first_sample": 0, "linear_inputs": []}
    post = spec.placement == "post"

    def add(kind_: str, name: str, x: np.ndarray) -> None:
        key = (kind_, name)
        if key not in accs:
            accs[key] = TensorAccumulator(name)
        accs[key].add(x)

    def residual(name, t) -> None:
        x = _np(t)
        layer = name if name == "embed" else int(name)
        massive.extend(find_massive(x, layer, state["first_sample"]))
        add("residual", name, x)
        if keep_first_window and state["first_sample"] == 0:
            first_window[layer] = np.abs(x[0])

    handles = []
    layers = loaded.layers

    def embed_hook(mod, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if x is not None:
            residual("embed", x)

    handles.append(layers[0].register_forward_pre_hook(embed_hook, with_kwargs=True))
    for i, block in enumerate(layers):
        handles.append(block.register_forward_hook(lambda mod, args, out, i=i: residual(str(i), _first(out))))

    # Where massive values are born: a block whose output has a massive entry its input lacks made
    # it; the sublayer whose output is largest there (attention or MLP, as the table names them) did.
    born: list[dict] = []
    block_inputs: dict[int, np.ndarray] = {}
    sub_outputs: dict[int, dict[str, np.ndarray]] = {}

    def block_in_hook(mod, args, kwargs, i):
        x = args[0] if args else kwargs.get("hidden_states")
        if x is not None:
            block_inputs[i] = _np(x)

    def sub_hook(mod, args, out, i, role):
        sub_outputs.setdefault(i, {})[role] = _np(_first(out))

    def block_out_hook(mod, args, out, i):
        x_in, x_out = block_inputs.pop(i, None), _np(_first(out))
        subs = sub_outputs.pop(i, {})
        if x_in is None or x_in.shape != x_out.shape:
            return
        before = {(r["sample"], r["position"], r["channel"]) for r in find_massive(x_in, i, 0)}
        for r in find_massive(x_out, i, 0):
            key = (r["sample"], r["position"], r["channel"])
            if key in before:
                continue
            s_, p_, c_ = key
            parts = {role: float(v[s_, p_, c_]) for role, v in subs.items() if v.shape == x_out.shape}
            origin = max(parts, key=lambda k: abs(parts[k])) if parts else None
            born.append({"layer": i, "sample": int(state["first_sample"] + s_), "position": int(p_), "channel": int(c_),
                         "value": r["value"], "ratio": r["ratio"], "input_value": float(x_in[s_, p_, c_]),
                         "born_in": f"{spec.layers}.{i}.{origin}" if origin else None, "sublayer_values": parts})

    for i, block in enumerate(layers):
        handles.append(block.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: block_in_hook(mod, args, kwargs, i), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda mod, args, out, i=i: block_out_hook(mod, args, out, i)))
        for role in (r for r in spec.sublayer_outputs if r):
            try:
                sub = block.get_submodule(role)
            except AttributeError:
                continue
            handles.append(sub.register_forward_hook(lambda mod, args, out, i=i, role=role: sub_hook(mod, args, out, i,
                                                                                                      role)))

    # What per-token and per-tensor INT8 do to each Linear input (fake quantization in numpy,
    # the pertoken recipe's and ORT's dynamic recipe's arithmetic): SQNR sums per input.
    sqnr_sums: dict[str, FakeQuantSqnr] = {}

    def input_sqnr(name: str, x: np.ndarray) -> None:
        sqnr_sums.setdefault(name, FakeQuantSqnr()).add(x)

    names = {m: n for n, m in model.named_modules()}
    for module in model.modules():
        if _is_norm(module):
            def norm_hook(mod, args, out):
                name = names[mod]
                add("norm", name, _np(_first(out)))
                if post and args:
                    x = _np(args[0])
                    add("norm_input", name, x)
                    massive.extend(find_massive(x, name, state["first_sample"], stream="pre-norm sum"))
            handles.append(module.register_forward_hook(norm_hook))
        elif isinstance(module, nn.Linear):
            def linear_hook(mod, args):
                x = args[0]
                name = names[mod]
                for seen, owner in state["linear_inputs"]:
                    if seen is x:  # q, k, v read one tensor: one row
                        if name not in modules_of[owner]:
                            modules_of[owner].append(name)
                        return
                state["linear_inputs"].append((x, name))
                modules_of.setdefault(name, [name])
                arr = _np(x)
                add("matmul", name, arr)
                input_sqnr(name, arr)
            handles.append(module.register_forward_pre_hook(linear_hook))

    attn_sum: dict[int, float] = {}
    attn_count: dict[int, int] = {}
    sep_sum: dict[int, float] = {}
    sep_count: dict[int, int] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                state["first_sample"] = start
                state["linear_inputs"] = []
                batch = torch.from_numpy(windows[start:start + batch_size])
                kwargs = {"use_cache": False} if kind == "causal" else {}
                out = model(input_ids=batch, output_attentions=True, **kwargs)
                for i, probs in enumerate(getattr(out, "attentions", None) or ()):
                    if probs is None:
                        continue
                    p = _np(probs)  # [B, H, T, T]
                    to_first = p[:, :, 1:, 0] if kind == "causal" else p[:, :, :, 0]
                    attn_sum[i] = attn_sum.get(i, 0.0) + float(to_first.sum(dtype=np.float64))
                    attn_count[i] = attn_count.get(i, 0) + to_first.size
                    if kind != "causal":
                        to_last = p[:, :, :, -1]
                        sep_sum[i] = sep_sum.get(i, 0.0) + float(to_last.sum(dtype=np.float64))
                        sep_count[i] = sep_count.get(i, 0) + to_last.size
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        state["linear_inputs"] = []

    token = token_namer(loaded.tokenizer, windows)

    def rows(kind_: str, key: str = "tensor") -> list[dict]:
        out = []
        for (k, name), acc in accs.items():  # insertion order = forward order
            if k != kind_:
                continue
            metrics = acc.finish().metrics()
            for entry in metrics["top"]:
                entry["token"] = token(entry["sample"], entry["position"])
            if key == "layer":
                out.append({"layer": name if name == "embed" else int(name), **metrics})
            else:
                row = {key: name, **metrics}
                if kind_ == "matmul":
                    row["modules"] = modules_of.get(name, [name])
                    row["sqnr_db_fake"] = sqnr_sums.get(name, FakeQuantSqnr()).to_dict()
                out.append(row)
        return out

    massive.sort(key=lambda r: -abs(r["value"]))
    massive_total = len(massive)
    massive = massive[:MASSIVE_LIMIT]
    for r in massive:
        r["token"] = token(r["sample"], r["position"])
    n_layers = len(layers)
    residual_rows = rows("residual", "layer")
    born.sort(key=lambda r: (r["layer"], -abs(r["value"])))
    for r in born:
        r["token"] = token(r["sample"], r["position"])
    matmul_rows = rows("matmul")
    massive_positions = {m["position"] for m in massive}
    for row in matmul_rows:
        top = row["top"][0] if row.get("top") else None
        # Carries the massive values: its largest |a| sits on a position that holds a massive
        # residual entry and is itself past Sun et al.'s absolute bar.
        row["carries_massive"] = bool(top and top["position"] in massive_positions and abs(top["value"]) > MASSIVE_ABS)
    report = {
        "residual": residual_rows,
        "massive_born": first_births(born),
        "residual_skip": [],
        "norm_outputs": rows("norm"),
        "norm_inputs": rows("norm_input"),
        "matmul_inputs": matmul_rows,
        "massive": massive,
        "massive_total": massive_total,
        "bos_attention": [attn_sum[i] / attn_count[i] if attn_count.get(i) else None for i in range(n_layers)],
        "n_samples": int(len(windows)),
        "seq_len": int(windows.shape[1]),
        "thresholds": {"massive_abs": MASSIVE_ABS, "massive_ratio": MASSIVE_RATIO,
                       "outlier_feature_abs": OUTLIER_FEATURE_ABS},
        "attention_key": "BOS (key 0), queries 1..T-1" if kind == "causal" else "[CLS] (key 0), all queries",
        "summary": summarize(residual_rows, massive, massive_total),
    }
    if kind != "causal":
        report["sep_attention"] = [sep_sum[i] / sep_count[i] if sep_count.get(i) else None for i in range(n_layers)]
    return report, first_window


def token_namer(tokenizer, windows: np.ndarray):
    def name(sample: int, position: int) -> str | None:
        try:
            tid = int(windows[sample, position])
            return str(tokenizer.convert_ids_to_tokens(tid))
        except Exception:  # noqa: BLE001 - a label only; never fail the probe for it
            return None
    return name


def heatmap_layer(residual_rows: list[dict]):
    return largest_ratio_layer(residual_rows)
