"""Training: AdamW, linear warm-up then cosine decay, gradient clipping, a per-step JSON-lines log.

Deterministic for a seed (on the same thread count): the torch generator seeds the weights, a
numpy generator picks the batches. A NaN/inf loss is a result ("diverged at step N"), not a crash.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import __version__, serial
from .data import DataConfig, PreparedData, evaluation_windows, prepare_data, sample_train_batch
from .errors import ConfigError, QuantnormError, RunDirError
from .fileio import atomic_path, write_json_atomic
from .measure.accuracy import torch_perplexity
from .models import CausalLM, ModelConfig
from .runs import CHECKPOINT_FILE, CONFIG_FILE, TRAIN_LOG_FILE, TRAIN_SUMMARY_FILE, RunDir, check_out_dir, config_hash
from .train_status import DEFAULT_COLLAPSE_MARGIN, classify, unigram_bits_per_byte

# A step is a gradient spike when its (pre-clip) gradient norm exceeds SPIKE_FACTOR times the
# median of the previous SPIKE_WINDOW steps' norms (needs at least SPIKE_WINDOW // 2 of them).
SPIKE_FACTOR = 3.0
SPIKE_WINDOW = 50


DEFAULT_WARMUP = 30


def default_warmup(steps: int) -> int:
    """The warm-up when none is given: DEFAULT_WARMUP steps, or a quarter of a shorter training
    (`quantnorm train`/`evaluate` without --warmup, a sweep without --warmups, the GPU bench)."""
    return min(DEFAULT_WARMUP, max(steps, 0) // 4)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = DEFAULT_WARMUP
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"steps must be > 0, got {self.steps}")
        if self.batch_size <= 0:
            raise ConfigError(f"batch size must be > 0, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"learning rate must be a positive number, got {self.lr}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0 steps, got {self.warmup}")
        if self.warmup > self.steps:
            raise ConfigError(f"warmup ({self.warmup}) is longer than training ({self.steps} steps): lower --warmup")
        if self.grad_clip <= 0:
            raise ConfigError(f"gradient clip must be > 0, got {self.grad_clip}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a trained checkpoint; its hash names a reusable run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        """The model, train and data sections (config.json's, and what a sweep cell is given);
        the hash is taken over it, so its layout decides which checkpoints are reused."""
        return serial.to_dict(self)

    def hash(self, corpus_sha256: str) -> str:
        return config_hash({**self.to_dict(), "corpus_sha256": corpus_sha256})

    @classmethod
    def from_dict(cls, d: dict, what: str = "the run configuration") -> RunConfig:
        """The exact inverse of ``to_dict``; an unknown key or a mistyped value is a ConfigError naming it."""
        return serial.from_dict(cls, d, what)


@dataclass(frozen=True)
class TrainResult:
    steps: int                      # steps actually run (fewer than asked when diverged)
    final_train_loss: float | None  # mean of the last 10 finite step losses, nats
    eval_bits_per_byte: float | None
    diverged: bool
    diverged_at: int | None
    gradient_spikes: int
    tokens_per_s: float
    wall_s: float
    # trained | collapsed | diverged (quantnorm.train_status): a run that ends no better than the
    # unigram baseline by collapse_margin bits/byte learned nothing an INT8 study can use
    status: str = "trained"
    unigram_bits_per_byte: float | None = None
    collapse_margin: float = DEFAULT_COLLAPSE_MARGIN

    def to_dict(self) -> dict:
        return asdict(self)


def lm_loss(model: CausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    # Weight decay on matrices only (not on norms, biases or embeddings' rows... of 1-D tensors).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def per_layer_grad_norms(model: CausalLM) -> dict[str, float]:
    """Gradient L2 norm per block (and for the embedding and the head) — Xiong et al.'s picture."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        parts = name.split(".")
        key = f"block{parts[1]}" if parts[0] == "blocks" else ("embed" if parts[0].endswith("emb") else parts[0])
        groups.setdefault(key, []).append(p.grad.detach().flatten())
    return {k: float(torch.linalg.vector_norm(torch.cat(v))) for k, v in groups.items()}


def ffn_grad_norms(model: CausalLM) -> dict[str, float]:
    """Gradient L2 norm of each block's FFN weight matrices (up and down projections, no biases):
    the quantity of Xiong et al.'s claim (their Fig. 3 shows the FFN sub-layers' weights)."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.grad is None or parts[0] != "blocks" or len(parts) < 4 or parts[2] != "mlp" or parts[-1] != "weight":
            continue
        groups.setdefault(f"block{parts[1]}", []).append(p.grad.detach().flatten())
    return {k: float(torch.linalg.vector_norm(torch.cat(v))) for k, v in groups.items()}


def count_spikes(grad_norms: list[float]) -> int:
    spikes = 0
    for i, g in enumerate(grad_norms):
        history = grad_norms[max(0, i - SPIKE_WINDOW):i]
        if len(history) >= SPIKE_WINDOW // 2 and g > SPIKE_FACTOR * statistics.median(history):
            spikes += 1
    return spikes


def eval_bits_per_byte(model: CausalLM, data: PreparedData) -> float:
    """Bits per byte on the evaluation range, by the protocol of FORMULAS.md (scored_from 0)."""
    inputs, targets = evaluation_windows(data.tokens, data.splits.evaluation, data.window)
    return torch_perplexity(model, inputs, targets, batch_size=32).bits_per_byte


def train(run: RunConfig, out_dir: Path, *, progress: bool = True, data: PreparedData | None = None) -> TrainResult:
    """Train a model and write config, log, checkpoint and summary into ``out_dir``.

    All inputs are validated (configs at construction, corpus here) before anything is written.
    """
    out_dir = check_out_dir(out_dir)
    data = data or prepare_data(run.data, run.model.context)
    torch.manual_seed(run.train.seed)
    rng = np.random.default_rng(run.train.seed)
    model = CausalLM(run.model)
    optimizer = make_optimizer(model, run.train)
    _start_run(run, out_dir, data, model)
    start = time.perf_counter()
    with atomic_path(out_dir / TRAIN_LOG_FILE) as log_path, open(log_path, "w", encoding="utf-8") as log:
        losses, grad_norms, diverged_at = _train_loop(run, model, optimizer, data, rng, log, progress)
    wall = time.perf_counter() - start
    with atomic_path(out_dir / CHECKPOINT_FILE) as ckpt:
        save_file(model.state_dict(), str(ckpt))
    result = _result(run.train, model, data, losses, grad_norms, diverged_at, wall)
    write_json_atomic(out_dir / TRAIN_SUMMARY_FILE, result.to_dict())
    return result


def _start_run(run: RunConfig, out_dir: Path, data: PreparedData, model: CausalLM) -> None:
    """Create ``out_dir`` and write the run's config; no summary is left from an earlier run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # train.json marks a finished run: remove an earlier run's before anything else, so a run
    # killed midway never looks finished under the new config.
    (out_dir / TRAIN_SUMMARY_FILE).unlink(missing_ok=True)
    config = {**run.to_dict(), "config_hash": run.hash(data.corpus.sha256), "n_params": model.n_params(),
              "data_ranges": data.describe(), "quantnorm_version": __version__}
    write_json_atomic(out_dir / CONFIG_FILE, config)


def _train_loop(run: RunConfig, model: CausalLM, optimizer: torch.optim.AdamW, data: PreparedData,
                rng: np.random.Generator, log, progress: bool) -> tuple[list[float], list[float], int | None]:
    """The steps, one JSON line each in ``log``; stops at the first non-finite loss or gradient.
    Returns (the finite steps' losses, their gradient norms, the step it diverged at or None)."""
    cfg = run.train
    losses: list[float] = []
    grad_norms: list[float] = []
    bar = tqdm(range(cfg.steps), desc=f"train {run.model.placement}/{run.model.norm}", disable=not progress,
               unit="step", dynamic_ncols=True, leave=False)
    model.train()
    try:
        for step in bar:
            x, y = sample_train_batch(data.tokens, data.splits.train, data.window, cfg.batch_size, rng)
            record = _step(model, optimizer, cfg, step, torch.from_numpy(x), torch.from_numpy(y))
            log.write(json.dumps(record) + "\n")
            if record.get("diverged"):
                return losses, grad_norms, step
            losses.append(record["loss"])
            grad_norms.append(record["grad_norm"])
            if step % 10 == 0:
                bar.set_postfix(loss=f"{record['loss']:.3f}")
    finally:
        bar.close()
    return losses, grad_norms, None


def _step(model: CausalLM, optimizer: torch.optim.AdamW, cfg: TrainConfig, step: int, x: torch.Tensor,
          y: torch.Tensor) -> dict:
    """One optimizer step at the scheduled learning rate; returns its log record (``diverged``
    set, and no update made, where the loss or the gradient norm is not finite)."""
    lr = cfg.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, x, y)
    loss_value = float(loss.detach())
    record: dict = {"step": step, "loss": loss_value, "lr": lr}
    if not math.isfinite(loss_value):
        record["diverged"] = True
        return record
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if step == 0:
        record["grad_norm_per_layer"] = per_layer_grad_norms(model)
        record["grad_norm_ffn_per_layer"] = ffn_grad_norms(model)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    if not math.isfinite(grad_norm):
        record.update(grad_norm=grad_norm, diverged=True)
        return record
    optimizer.step()
    record["grad_norm"] = grad_norm
    return record


def _result(cfg: TrainConfig, model: CausalLM, data: PreparedData, losses: list[float], grad_norms: list[float],
            diverged_at: int | None, wall: float) -> TrainResult:
    """The run's summary: eval bits/byte (not for a diverged run), spikes, speed and status."""
    bits = None if diverged_at is not None else eval_bits_per_byte(model, data)
    unigram = unigram_bits_per_byte(data.corpus.data, data.splits.train, data.splits.evaluation)
    steps_run = len(losses)
    return TrainResult(
        steps=steps_run,
        final_train_loss=float(np.mean(losses[-10:])) if losses else None,
        eval_bits_per_byte=bits,
        diverged=diverged_at is not None,
        diverged_at=diverged_at,
        gradient_spikes=count_spikes(grad_norms),
        tokens_per_s=steps_run * cfg.batch_size * data.window / wall if wall > 0 else 0.0,
        wall_s=wall,
        status=classify(bits, diverged_at is not None, unigram, DEFAULT_COLLAPSE_MARGIN),
        unigram_bits_per_byte=unigram,
        collapse_margin=DEFAULT_COLLAPSE_MARGIN,
    )


def load_model(run_dir: RunDir) -> tuple[CausalLM, RunConfig]:
    """Rebuild the model of a trained run directory from its config and safetensors weights."""
    config = run_dir.read_json(CONFIG_FILE)
    try:
        # config.json also records its hash, the parameter count and the data ranges beside the config
        run = RunConfig.from_dict({k: config[k] for k in ("model", "train", "data")})
    except (KeyError, TypeError, QuantnormError) as exc:
        raise RunDirError(f"{run_dir.file(CONFIG_FILE)} is not a quantnorm run config ({exc}); train the run again") from None
    model = CausalLM(run.model)
    try:
        model.load_state_dict(load_file(str(run_dir.file(CHECKPOINT_FILE))))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise RunDirError(f"cannot load {run_dir.file(CHECKPOINT_FILE)}: {exc}; train the run again") from None
    return model.eval(), run
