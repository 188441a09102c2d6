"""Training throughput (tokens/s) per placement x norm at the default model size.

Run:  python benchmarks/train_throughput.py [--steps 30] [--placements pre,post] [--norms layer,rms]

Prints one table row per combination. Run it alone: ONNX Runtime or other jobs beside it
distort the numbers (this machine has 2 cores).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from quantnorm.data import DataConfig, prepare_data, sample_train_batch
from quantnorm.hardware import cpu_model
from quantnorm.models import NORMS, PLACEMENTS, CausalLM, ModelConfig
from quantnorm.train import TrainConfig, lm_loss, make_optimizer


def tokens_per_s(cfg: ModelConfig, steps: int, batch_size: int, warmup: int = 3) -> float:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    data = prepare_data(DataConfig(), cfg.context)
    model = CausalLM(cfg).train()
    optimizer = make_optimizer(model, TrainConfig(batch_size=batch_size))
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = sample_train_batch(data.tokens, data.splits.train, cfg.context, batch_size, rng)
        loss = lm_loss(model, torch.from_numpy(x), torch.from_numpy(y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * batch_size * cfg.context / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--norms", default=",".join(NORMS))
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}, batch {args.batch_size}, "
          f"{args.steps} timed steps")
    print(f"{'placement':<10} {'norm':<6} {'params':>9} {'tokens/s':>10} {'s/step':>7}")
    for placement in args.placements.split(","):
        for norm in args.norms.split(","):
            cfg = ModelConfig(placement=placement, norm=norm)
            tps = tokens_per_s(cfg, args.steps, args.batch_size)
            print(f"{placement:<10} {norm:<6} {CausalLM(cfg).n_params():>9,} {tps:>10,.0f} "
                  f"{args.batch_size * cfg.context / tps:>7.3f}")


if __name__ == "__main__":
    main()
