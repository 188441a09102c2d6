"""The zoo source: a run directory of ``quantnorm train`` (one of the placement x norm models).

Byte-level windows from the run's own corpus splits (scored byte-level, FORMULAS.md), the
PyTorch parity-checked export, the zoo's SmoothQuant fold and online rotation, its with-past
graphs, and the trained model for the diagnostics the pipeline measures on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..calibration import calibration_windows
from ..data import PreparedData, evaluation_windows, prepare_data
from ..errors import ConfigError, QuantizeError
from ..export import export_onnx
from ..generation.with_past import WithPastSource, ZooWithPast, export_with_past, parity_prompts
from ..runs import PAST_SUFFIX, TRAIN_SUMMARY_FILE, RunDir, check_out_dir, past_file
from ..train import RunConfig, load_model, train
from ..transforms.rotation import (
    RotatedExport,
    export_online_rotated,
    online_rotated_copy,
    rotated_onnx_file,
    rotation_block,
)
from ..transforms.smoothquant import smooth_model, smoothing
from ..transforms.variants import FP32Variants
from .base import Scoring, SearchScoring, SourceData, TorchChecks


def _online_only(recipe) -> None:
    if recipe.rotation != "online" and rotation_block(recipe.rotation) is None:
        raise ConfigError(f"recipe {recipe.name}: the residual-stream rotation (forms a and d) folds the norm weights "
                          "of a Pre-RMSNorm Llama-family checkpoint (quantnorm.transforms.rotation); a zoo model "
                          "takes the online forms, online-rotated-pertoken-fused or block-rotated-wo-...-acc4")


def zoo_rotation(model, parity_inputs: np.ndarray, out_dir: Path, opset: int):
    """The zoo's rotated export: an online form (a zoo model has no Pre-RMSNorm stream to fold)."""
    def rotate(recipe) -> RotatedExport:
        _online_only(recipe)
        return export_online_rotated(model, parity_inputs, Path(out_dir) / rotated_onnx_file(recipe.rotation),
                                     opset=opset, block=rotation_block(recipe.rotation))
    return rotate


def zoo_with_past(model, calib_inputs: np.ndarray, prompts: np.ndarray, out_dir: Path, opset: int) -> WithPastSource:
    """The zoo model's with-past graphs: the model itself, its smoothed copies, its online-rotated copy."""
    def export(module, path: Path):
        return export_with_past(ZooWithPast(module), path, prompts, opset=opset)

    def smooth(alpha: float, path: Path):
        return export(smooth_model(model, calib_inputs, alpha)[0], path)

    def rotate(recipe):
        _online_only(recipe)
        rotated = online_rotated_copy(model, rotation_block(recipe.rotation))[0]
        return export(rotated, Path(out_dir) / past_file(rotated_onnx_file(recipe.rotation)))
    return WithPastSource(export=lambda path: export(model, path),
                          variants=FP32Variants(out_dir, smooth=smooth, rotate=rotate, suffix=PAST_SUFFIX))


def ensure_trained(run: RunConfig, out_dir: Path, data: PreparedData, progress: bool) -> RunDir:
    """Reuse the run directory's checkpoint when its config hash matches, else train it."""
    run_dir = RunDir(check_out_dir(out_dir))
    if run_dir.stored_hash() == run.hash(data.corpus.sha256):
        return run_dir
    train(run, out_dir, progress=progress, data=data)
    return run_dir


class ZooSource:
    kind = "zoo"

    def __init__(self, run_dir: RunDir):
        self.run = run_dir
        self.run_dir = run_dir.path

    def prepare(self, cfg) -> None:
        self.model, self.config = load_model(self.run)
        self.train_summary = self.run.read_json(TRAIN_SUMMARY_FILE)
        if self.train_summary.get("diverged"):
            raise QuantizeError(
                f"{self.run_dir}: training diverged at step {self.train_summary.get('diverged_at')}; there is no "
                f"model to deploy (retrain with warm-up or a lower --lr)")
        self.prepared = prepare_data(self.config.data, self.config.model.context)
        window = self.prepared.window
        eval_inputs, eval_targets = evaluation_windows(self.prepared.tokens, self.prepared.splits.evaluation, window)
        calib_inputs = calibration_windows(self.prepared.tokens, self.prepared.splits.calibration, window,
                                           cfg.calib_samples)
        self.data = SourceData(window, eval_inputs, eval_targets, calib_inputs,
                               {**self.prepared.describe(), "n_eval_windows": int(len(eval_inputs)),
                                "n_calib_windows": int(len(calib_inputs))})
        self.table_placement = self.config.model.placement

    def export(self, fp32_path: Path, cfg) -> dict:
        exported = export_onnx(self.model, fp32_path, self.data.eval_inputs[: cfg.parity_windows], opset=cfg.opset)
        return exported.to_dict(self.run_dir)

    def with_past(self, cfg) -> WithPastSource:
        prompts = parity_prompts(self.data.eval_inputs, self.config.model.context, cfg.parity_windows)
        return zoo_with_past(self.model, self.data.calib_inputs, prompts, self.run_dir, cfg.opset)

    def transforms(self, cfg) -> FP32Variants:
        """The zoo's SmoothQuant exports (one per alpha) and its rotated export, each made on first use."""
        parity = self.data.eval_inputs[: cfg.parity_windows]
        return FP32Variants(self.run_dir, smooth=smoothing(self.model, self.data.calib_inputs, parity, opset=cfg.opset),
                            rotate=zoo_rotation(self.model, parity, self.run_dir, cfg.opset))

    def scoring(self, cfg) -> Scoring:
        return Scoring("byte", self.data.eval_inputs, self.data.eval_targets, cfg.eval_batch_size)

    def search_scoring(self, cfg) -> SearchScoring:
        return SearchScoring(self.data.eval_inputs, self.data.eval_targets, level="byte")

    def probe_options(self) -> dict:
        return {"n_blocks": self.config.model.n_layers, "causal": True}

    def torch_checks(self, cfg) -> TorchChecks:
        """The trained model, for the diagnostics (perturbation sensitivity, block-output similarity)."""
        return TorchChecks(diagnostics=self.model)

    def sections(self, detected: dict) -> dict:
        return {
            # paths in results are relative to the run directory (no machine path)
            "model": {**self.config.model.to_dict(), "n_params": self.model.n_params(), "source": "trained",
                      "run_dir": ".", "placement_detected": detected},
            "data": self.data.describe,
            "train": {**self.train_summary, "config": self.config.to_dict()["train"]},
        }


