"""What a sweep is: its grid (placements x norms x seeds, and warm-ups, depths and learning rates),
the training flags and the one EvaluateConfig every cell shares, each cell's configuration (its
cell.json) and the arguments of its process. Validated before anything is written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import serial
from ..config import EvaluateConfig
from ..data import BUILTIN_PYDOC, DataConfig, prepare_data
from ..errors import ConfigError
from ..models import NORMS, PLACEMENTS, ModelConfig
from ..train import RunConfig, TrainConfig, default_warmup

CELL_CONFIG_FILE = "cell.json"
# The settings a sweep directory's cells may differ in: its axes, which may grow. Every other
# setting (the training flags, each field of the EvaluateConfig) must stay equal.
AXES = ("placements", "norms", "seeds", "warmups", "depths", "lrs")


def _unique(values, what: str) -> tuple:
    out = tuple(dict.fromkeys(values))
    if not out:
        raise ConfigError(f"no {what} given: pass at least one value")
    return out


@dataclass(frozen=True)
class SweepConfig:
    """The grid, the training flags every cell shares and the one EvaluateConfig every cell gets.
    Validated at construction; nothing is written."""

    placements: tuple[str, ...] = tuple(PLACEMENTS)
    norms: tuple[str, ...] = tuple(NORMS)
    seeds: int = 3
    warmups: tuple[int, ...] | None = None   # None: train.default_warmup(steps), as `quantnorm train`
    depths: tuple[int, ...] = (ModelConfig.n_layers,)
    # None: every cell trains at ``lr``. A tuple is a learning-rate axis: the report compares each
    # placement at its own best rate, chosen on held-out seeds (compare.tuned_comparison)
    lrs: tuple[float, ...] | None = None
    d_model: int = ModelConfig.d_model
    heads: int = ModelConfig.n_heads
    context: int = ModelConfig.context
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    corpus: str = BUILTIN_PYDOC
    # Every cell gets this, as it stands, but for ``threads`` when it is None (the executor gives
    # each cell its share of the cores) and ``progress`` (off: a cell writes to its log file).
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(progress=False))

    def __post_init__(self) -> None:
        placements = _unique(self.placements, "placements")
        norms = _unique(self.norms, "norms")
        for p in placements:
            if p not in PLACEMENTS:
                raise ConfigError(f"unknown placement {p!r} in --placements: choose from {', '.join(PLACEMENTS)}")
        for n in norms:
            if n not in NORMS:
                raise ConfigError(f"unknown norm {n!r} in --norms: choose from {', '.join(NORMS)}")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"--seeds is the number of seeds and must be >= 1, got {self.seeds}")
        depths = _unique(self.depths, "depths")
        if min(depths) < 1:
            raise ConfigError(f"--depths must be >= 1 layers, got {min(depths)}")
        warmups = None if self.warmups is None else _unique(self.warmups, "warm-ups")
        if warmups is not None and min(warmups) < 0:
            raise ConfigError(f"--warmups must be >= 0 steps, got {min(warmups)}")
        lrs = None if self.lrs is None else _unique((float(x) for x in self.lrs), "learning rates")
        if lrs is not None and not all(x > 0 and x == x and x != float("inf") for x in lrs):
            raise ConfigError(f"--lrs must be positive learning rates, got {', '.join(map(repr, lrs))}")
        object.__setattr__(self, "lrs", lrs)
        if self.corpus != BUILTIN_PYDOC:
            object.__setattr__(self, "corpus", str(Path(self.corpus).expanduser().resolve()))
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "norms", norms)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "warmups", warmups)
        if self.evaluate.progress:
            object.__setattr__(self, "evaluate", replace(self.evaluate, progress=False))

    def cells(self) -> list[Cell]:
        warmups = self.warmups if self.warmups is not None else (default_warmup(self.steps),)
        lrs = self.lrs if self.lrs is not None else (None,)
        return [Cell(p, n, d, w, s, lr) for d in self.depths for w in warmups for lr in lrs for p in self.placements
                for n in self.norms for s in range(self.seeds)]

    def to_dict(self) -> dict:
        """sweep.json's ``settings``: the axes and training flags under their flag names (what the
        comparison report prints), and ``evaluate``, the serialized EvaluateConfig."""
        return serial.to_dict(self)


@dataclass(frozen=True)
class Cell:
    placement: str
    norm: str
    depth: int
    warmup: int
    seed: int
    lr: float | None = None   # None: the sweep's --lr (and no lr in the name, as before the axis existed)

    @property
    def name(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        return f"{self.placement}-{self.norm}-L{self.depth}-w{self.warmup}{lr}-seed{self.seed}"

    def lr_of(self, cfg: SweepConfig) -> float:
        return cfg.lr if self.lr is None else self.lr

    def run_config(self, cfg: SweepConfig) -> RunConfig:
        return RunConfig(
            model=ModelConfig(placement=self.placement, norm=self.norm, n_layers=self.depth, d_model=cfg.d_model,
                              n_heads=cfg.heads, context=cfg.context),
            train=TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=self.lr_of(cfg), warmup=self.warmup,
                              seed=self.seed),
            data=DataConfig(corpus=cfg.corpus),
        )

    def config(self, cfg: SweepConfig, threads: int | None) -> dict:
        """What the cell's process is given (its cell.json): the RunConfig to train and the
        sweep's EvaluateConfig, with ``threads`` when the sweep left them to the executor."""
        evaluate = cfg.evaluate if cfg.evaluate.threads is not None else replace(cfg.evaluate, threads=threads)
        return cell_config(self.run_config(cfg), evaluate)


def cell_config(run: RunConfig, evaluate: EvaluateConfig) -> dict:
    return {"run": run.to_dict(), "evaluate": evaluate.to_dict()}


def read_cell_config(path: str | Path) -> tuple[RunConfig, EvaluateConfig]:
    """The RunConfig and EvaluateConfig of a cell.json (``quantnorm evaluate --config FILE``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--config {path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict) or set(data) != {"run", "evaluate"}:
        keys = ", ".join(map(repr, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--config {path} must be a JSON object with the keys 'run' and 'evaluate', got {keys}")
    return (RunConfig.from_dict(data["run"], f"--config {path}: run"),
            EvaluateConfig.from_dict(data["evaluate"], f"--config {path}: evaluate"))


def cell_args(cell_dir: Path) -> list[str]:
    """The `quantnorm` arguments of a cell's process: everything else is in its cell.json."""
    return ["evaluate", "--config", str(cell_dir / CELL_CONFIG_FILE), "--out", str(cell_dir), "--quiet"]


def validate(cfg: SweepConfig) -> list[Cell]:
    """Check everything a cell would check (model and training configs, the corpus; the
    EvaluateConfig validated itself) before anything is written; returns the cells."""
    cells = cfg.cells()
    for cell in cells:
        cell.run_config(cfg)  # ConfigError on e.g. heads not dividing d_model, warm-up longer than training
    prepare_data(DataConfig(corpus=cfg.corpus), cfg.context)  # DataError on a missing/empty/small corpus
    return cells
