"""The zoo source: a run directory of ``quantnorm train`` (one of the placement x norm models).

Byte-level windows from the run's own corpus splits, the PyTorch parity-checked export, the
zoo's SmoothQuant fold, byte-level accuracy (FORMULAS.md) and the diagnostics that need the
torch model (the probe itself reads the graph, as for every source).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..calibration import calibration_windows
from ..data import PreparedData, evaluation_windows, prepare_data
from ..errors import ConfigError, ExportError, QuantizeError
from ..export import export_onnx
from ..measure.accuracy import compare, run_logits
from ..measure.diagnostics import diagnostics
from ..measure.sessions import SessionSpec, make_session
from ..module_export import max_output_diff
from ..runs import TRAIN_SUMMARY_FILE, RunDir, check_out_dir
from ..train import RunConfig, load_model, train
from ..transforms.rotation import RotatedExport, online_plan, rotate_every_linear_input
from ..transforms.smoothquant import DEFAULT_PARITY_TOLERANCE, SmoothedModels, torch_logits
from .base import SearchScoring, SourceData

ROTATED_ONLINE_ONNX_FILE = "model.fp32.rotated-online.onnx"


def export_online_rotated(model, parity_inputs: np.ndarray, out_path: Path, *, opset: int,
                          tolerance: float = DEFAULT_PARITY_TOLERANCE) -> RotatedExport:
    """Form (b) of the rotation on a zoo model (every Linear's input rotated in the graph; exact for
    every placement, the head is already untied) and its export, checked twice: the ONNX file against
    the rotated torch model (the export's own gate), then against the *original* model's logits,
    relative to their scale (the INT8 model is judged against the original). A failure keeps no file."""
    rotated = copy.deepcopy(model).eval()
    count, widths = rotate_every_linear_input(rotated)
    out_path = Path(out_path)
    exported = export_onnx(rotated, out_path, parity_inputs, opset=opset)
    got = np.concatenate(list(run_logits(make_session(out_path, SessionSpec(threads=1)), np.asarray(parity_inputs))))
    diff = max_output_diff([torch_logits(model, np.asarray(parity_inputs))], [got], relative=True)
    if not diff <= tolerance:
        out_path.unlink(missing_ok=True)
        raise ExportError(f"rotated ONNX model does not match the original model: max relative |delta logit| = "
                          f"{diff:.3g} > {tolerance:g}; no file kept")
    plan = online_plan(model.cfg.d_model, count, widths, model.cfg.n_layers, untied=False)
    return RotatedExport(out_path, plan, exported, diff)


class ZooTransforms(SmoothedModels):
    """The zoo's SmoothQuant exports (one per alpha) and its rotated export, each made on first use."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotated: dict[str, RotatedExport] = {}

    def fp32_for(self, recipe, default: Path) -> Path:
        form = getattr(recipe, "rotation", None)
        if form is None:
            return super().fp32_for(recipe, default)
        if form != "online":
            raise ConfigError(f"recipe {recipe.name}: the residual-stream rotation (form a) folds the norm weights "
                              "of a Pre-RMSNorm Llama-family checkpoint (quantnorm.transforms.rotation); a zoo model takes "
                              "the online form, online-rotated-pertoken-fused")
        if form not in self.rotated:
            self.rotated[form] = export_online_rotated(self.model, self.parity_inputs,
                                                       self.out_dir / ROTATED_ONLINE_ONNX_FILE, opset=self.opset)
        return self.rotated[form].path


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

    def transforms(self, cfg) -> ZooTransforms:
        return ZooTransforms(self.model, self.data.calib_inputs, self.data.eval_inputs[: cfg.parity_windows],
                              self.run_dir, opset=cfg.opset)

    def accuracy(self, fp32_session, cfg) -> Callable:
        def score(int8_session) -> dict:
            return compare(fp32_session, int8_session, self.data.eval_inputs, self.data.eval_targets,
                           batch_size=cfg.eval_batch_size).to_dict()
        return score

    def search_scoring(self, cfg) -> SearchScoring:
        return SearchScoring(self.data.eval_inputs, self.data.eval_targets, scorer=None, level="byte")

    def probe_options(self) -> dict:
        return {"n_blocks": self.config.model.n_layers, "causal": True}

    def extras(self, cfg, timed: Callable) -> dict:
        """The torch-side diagnostics (perturbation sensitivity, block-output similarity)."""
        with timed("diagnostics"):
            return {"diagnostics": diagnostics(self.model, self.data.eval_inputs[: cfg.probe_windows])}

    def sections(self, detected: dict) -> dict:
        return {
            # paths in results are relative to the run directory (no machine path)
            "model": {**self.config.model.to_dict(), "n_params": self.model.n_params(), "source": "trained",
                      "run_dir": ".", "placement_detected": detected},
            "data": self.data.describe,
            "train": {**self.train_summary, "config": self.config.to_dict()["train"]},
        }


