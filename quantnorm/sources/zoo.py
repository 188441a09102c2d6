"""The zoo source: a run directory of ``quantnorm train`` (one of the placement x norm models).

Byte-level windows from the run's own corpus splits, the PyTorch parity-checked export, the
zoo's SmoothQuant fold, byte-level accuracy (FORMULAS.md), the hook-based probe (which knows
the blocks' sublayers by name) and the diagnostics that need the torch model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..calibration import calibration_windows
from ..data import PreparedData, evaluation_windows, prepare_data
from ..errors import QuantizeError
from ..export import export_onnx
from ..measure.accuracy import compare
from ..measure.diagnostics import diagnostics
from ..measure.outliers import heatmap_for_layer, largest_ratio_layer, probe
from ..measure.sqnr import matmul_input_modules, sqnr_sections
from ..plots import plot_activation_heatmap
from ..report import write_report
from ..runs import PLOTS_DIR, TRAIN_SUMMARY_FILE, RunDir, check_out_dir
from ..smoothquant import SmoothedModels
from ..train import RunConfig, load_model, train
from .base import SearchScoring, SourceData


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

    def transforms(self, cfg) -> SmoothedModels:
        return SmoothedModels(self.model, self.data.calib_inputs, self.data.eval_inputs[: cfg.parity_windows],
                              self.run_dir, opset=cfg.opset)

    def accuracy(self, fp32_session, cfg) -> Callable:
        def score(int8_session) -> dict:
            return compare(fp32_session, int8_session, self.data.eval_inputs, self.data.eval_targets,
                           batch_size=cfg.eval_batch_size).to_dict()
        return score

    def search_scoring(self, cfg) -> SearchScoring:
        return SearchScoring(self.data.eval_inputs, self.data.eval_targets, scorer=None, level="byte")

    def probe(self, fp32_path: Path, int8_paths: dict[str, Path], cfg, fp32_sources: dict[str, Path],
              timed: Callable) -> dict:
        """The ``outliers``, ``sqnr`` and ``sqnr_summary`` sections, the activation heat map of the
        layer with the largest ratio, and the torch-side ``diagnostics``.

        SQNR's correlation with outlier figures is taken over the inputs of weight MatMuls
        (attention probabilities are mostly exact zeros from the causal mask, so their max/median
        ratios are meaningless and would swamp the correlation)."""
        inputs = self.data.eval_inputs[: cfg.probe_windows]
        with timed("outliers"):
            report = probe(self.model, inputs).to_dict()
            sqnr, summaries = sqnr_sections(fp32_path, int8_paths, inputs[:8],
                                            matmul_input_modules(fp32_path, self.model), fp32_sources)
            layer = largest_ratio_layer(report["residual"])
            plot_activation_heatmap(heatmap_for_layer(self.model, inputs[:1], layer),
                                    self.run.file(PLOTS_DIR) / "heatmap.png",
                                    f"|a| of the residual stream at layer {layer} (first evaluation window)")
            report["heatmap_layer"] = layer
        with timed("diagnostics"):
            diag = diagnostics(self.model, inputs)
        return {"outliers": report, "sqnr": sqnr, "sqnr_summary": summaries, "diagnostics": diag}

    def sections(self, detected: dict) -> dict:
        return {
            # paths in results are relative to the run directory (no machine path)
            "model": {**self.config.model.to_dict(), "n_params": self.model.n_params(), "source": "trained",
                      "run_dir": ".", "placement_detected": detected},
            "data": self.data.describe,
            "train": {**self.train_summary, "config": self.config.to_dict()["train"]},
        }

    def write_report(self, results: dict) -> Path:
        return write_report(self.run_dir, results)

