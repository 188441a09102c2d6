"""LayerNorm vs RMSNorm speed: ONNX Runtime FP32 latency (native and decomposed norm ops) and training.

Run:  python benchmarks/norm_speed.py [--iters 30] [--steps 10] [--batch 8] [--placement pre]
                                     [--opt-level ORT_ENABLE_ALL] [--threads N]

Claim 9 of shared CLAIMS.md: RMSNorm is faster than LayerNorm (7-64% reported); an optimized
LayerNorm closes the gap. At the default model size (quantnorm.models.ModelConfig defaults,
random init: speed does not depend on what the weights learned) each norm is exported with
quantnorm.export.export_onnx at

- opset 18: LayerNorm as the native ``LayerNormalization``, RMSNorm *decomposed* (Pow, ReduceMean,
  Add, Sqrt, Div, Mul: there is no RMSNorm op before opset 23);
- opset 23: LayerNorm as ``LayerNormalization``, RMSNorm as the native ``RMSNormalization``;

and timed on the ONNX Runtime CPU provider (quantnorm.measure.latency.bench_model, FP32, random
ids [batch, context]). The ``graph norm ops`` column counts what the exported file holds; the
``ORT kernels`` column what ONNX Runtime ran after its graph optimizations (from its profile: at
ORT_ENABLE_ALL a decomposed RMSNorm may be fused into ``SimplifiedLayerNormalization``, so
"decomposed" in the file need not be decomposed at run time). The last column is the PyTorch
training step time (forward, backward, AdamW step) of the same model, batch ``--batch``.

A row that cannot be measured here (e.g. an onnxruntime without opset 23) says why instead.
Run it alone on the machine: anything running beside it distorts the numbers (2 cores here).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from quantnorm.data import DataConfig, evaluation_windows, prepare_data, sample_train_batch
from quantnorm.errors import QuantnormError
from quantnorm.export import export_onnx
from quantnorm.hardware import cpu_model
from quantnorm.measure.latency import bench_model
from quantnorm.measure.sessions import SessionSpec
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.train import TrainConfig, lm_loss, make_optimizer

NORMS = ("layer", "rms")
OPSETS = (18, 23)


def train_step_ms(cfg: ModelConfig, data, steps: int, batch_size: int, warmup: int = 2) -> float:
    """Median wall time of one training step (ms) over ``steps`` steps after ``warmup``."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = CausalLM(cfg).train()
    optimizer = make_optimizer(model, TrainConfig(batch_size=batch_size))
    times = []
    for step in range(warmup + steps):
        x, y = sample_train_batch(data.tokens, data.splits.train, cfg.context, batch_size, rng)
        start = time.perf_counter()
        loss = lm_loss(model, torch.from_numpy(x), torch.from_numpy(y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def _ops(counts: dict | None, keep=lambda op: "Norm" in op, none: str = "–") -> str:
    items = sorted((op, n) for op, n in (counts or {}).items() if n and keep(op))
    return ", ".join(f"{op} {n}" for op, n in items) or none


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="timed ONNX Runtime runs per model")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per norm")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--placement", default=ModelConfig.placement)
    parser.add_argument("--opt-level", default="ORT_ENABLE_ALL")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: ORT's)")
    args = parser.parse_args()

    base = ModelConfig(placement=args.placement)
    data = prepare_data(DataConfig(), base.context)
    parity, _ = evaluation_windows(data.tokens, data.splits.evaluation, base.context)
    spec = SessionSpec(graph_optimization_level=args.opt_level, threads=args.threads)
    print(f"CPU: {cpu_model()}; {base.placement}, d_model {base.d_model}, {base.n_layers} layers, "
          f"context {base.context}, batch {args.batch}; ORT {spec.graph_optimization_level}, "
          f"threads {spec.threads or 'default'}, {args.iters} timed runs; torch threads {torch.get_num_threads()}, "
          f"{args.steps} timed training steps")
    header = (f"{'norm':<6} {'opset':>5} {'graph norm ops':<28} {'ORT kernels (norm)':<48} {'p50 ms':>8} "
              f"{'p90 ms':>8} {'train ms/step':>13}")
    print(header)
    print("-" * len(header))
    p50: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for norm in NORMS:
            cfg = ModelConfig(placement=args.placement, norm=norm)
            torch.manual_seed(0)
            model = CausalLM(cfg).eval()
            step_ms = train_step_ms(cfg, data, args.steps, args.batch)
            for opset in OPSETS:
                try:
                    exported = export_onnx(model, Path(tmp) / f"{norm}-{opset}.onnx", parity[:2], opset=opset)
                    row = bench_model(exported.path, variant="fp32", spec=spec, batch=args.batch, seq=cfg.context,
                                      iters=args.iters, is_quantized=False)
                except QuantnormError as exc:
                    print(f"{norm:<6} {opset:>5} not measured: {str(exc).splitlines()[0]}")
                    continue
                if row.p50_ms is None:
                    print(f"{norm:<6} {opset:>5} {row.status}")
                    continue
                p50[(norm, opset)] = row.p50_ms
                kernels = (row.node_ops or {}).get(spec.provider)
                print(f"{norm:<6} {opset:>5} {_ops(exported.norm_ops, lambda op: True):<28} "
                      f"{_ops(kernels, none='none (elementwise ops)' if kernels else '–'):<48} {row.p50_ms:>8.2f} {row.p90_ms:>8.2f} {step_ms:>13.1f}")
    for opset in OPSETS:
        if (("layer", opset) in p50) and (("rms", opset) in p50):
            gain = p50[("layer", opset)] / p50[("rms", opset)] - 1
            print(f"opset {opset}: RMSNorm model {100 * gain:+.1f}% faster than LayerNorm model (p50, ORT FP32)")


if __name__ == "__main__":
    main()
