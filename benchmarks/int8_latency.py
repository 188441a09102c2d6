"""INT8 / FP32 p50 latency ratio per recipe, side by side, at d_model 512, 6 layers, batch 8.

Run:  python benchmarks/int8_latency.py [--recipes a,b] [--iters 30] [--d-model 512 --layers 6 --batch 8]

The model is randomly initialized (latency does not depend on what the weights learned; training a
d_model-512 model here would take far longer than the benchmark). Calibration uses windows of the
built-in corpus. Prints one row per recipe with p50 and the ratio to FP32 under ORT_ENABLE_ALL
on the CPU provider. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from quantnorm.calibration import calibration_windows
from quantnorm.data import DataConfig, evaluation_windows, prepare_data
from quantnorm.export import export_onnx
from quantnorm.hardware import cpu_has_vnni, cpu_model
from quantnorm.measure.latency import bench_model
from quantnorm.measure.sessions import SessionSpec
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.quantize import RECIPES, get_recipe, quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--placement", default="pre")
    parser.add_argument("--norm", default="rms")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--calib-samples", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(placement=args.placement, norm=args.norm, n_layers=args.layers, d_model=args.d_model,
                      n_heads=args.heads, context=args.context)
    model = CausalLM(cfg).eval()
    data = prepare_data(DataConfig(), cfg.context)
    eval_inputs, _ = evaluation_windows(data.tokens, data.splits.evaluation, cfg.context)
    calib = calibration_windows(data.tokens, data.splits.calibration, cfg.context, args.calib_samples)
    spec = SessionSpec(graph_optimization_level="ORT_ENABLE_ALL")
    vnni = cpu_has_vnni()
    print(f"CPU: {cpu_model()} (VNNI: {vnni}); {cfg.placement}/{cfg.norm}, d_model {cfg.d_model}, "
          f"{cfg.n_layers} layers, batch {args.batch}, seq {cfg.context}, ORT_ENABLE_ALL, {args.iters} timed runs")
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export_onnx(model, Path(tmp) / "fp32.onnx", eval_inputs[:2]).path
        base = bench_model(fp32, variant="fp32", spec=spec, batch=args.batch, seq=cfg.context, iters=args.iters)
        print(f"{'variant':<36} {'p50 ms':>9} {'p90 ms':>9} {'int8/fp32':>10} {'size MB':>8}")
        print(f"{'fp32':<36} {base.p50_ms:>9.1f} {base.p90_ms:>9.1f} {1.0:>10.2f} {fp32.stat().st_size / 1e6:>8.2f}")
        for name in args.recipes.split(","):
            q = quantize(fp32, get_recipe(name), calib, Path(tmp) / f"{name}.onnx", vnni=vnni,
                         probe_inputs=eval_inputs[:1])
            if q.status != "ok":
                print(f"{name:<36} {q.status}")
                continue
            row = bench_model(q.path, variant=name, spec=spec, batch=args.batch, seq=cfg.context, iters=args.iters)
            print(f"{name:<36} {row.p50_ms:>9.1f} {row.p90_ms:>9.1f} {row.p50_ms / base.p50_ms:>10.2f} "
                  f"{q.path.stat().st_size / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
