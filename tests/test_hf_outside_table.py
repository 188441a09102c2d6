"""Architectures outside the loader table (quantnorm.sources.hf_loader.ARCHITECTURES) run through
``quantnorm evaluate --model DIR``: an encoder (MPNet, as sentence-transformers saves it, and
DeBERTa-v2) with AutoModel, a decoder (Phi) with AutoModelForCausalLM. Their placement and norm
are read from the exported graph and reported as detected there; the recipes that need a fold rule
(SmoothQuant, the stream rotation) say why they are not applicable and the rest run. Tiny models
built from transformers' config classes, with the tiny tokenizer of test_hf: nothing downloaded."""

import json

import numpy as np
import pytest
import torch
import transformers
from test_hf import VOCAB, tiny_tokenizer

from quantnorm.cli import main
from quantnorm.measure.placement import detect_placement
from quantnorm.results import NOT_APPLICABLE_PREFIX
from quantnorm.sources.hf_export import export_hf_onnx, make_wrapper, output_names
from quantnorm.sources.hf_loader import ARCHITECTURES, GRAPH_DETECTED_FROM, inspect_checkpoint, load_checkpoint

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# name -> (model class, config, encoder?, expected placement / norm read from the graph)
MODELS = {
    "mpnet": (transformers.MPNetForMaskedLM, lambda: transformers.MPNetConfig(**SMALL, max_position_embeddings=130),
              True, ("post", "layer")),
    "deberta-v2": (transformers.DebertaV2Model,
                   lambda: transformers.DebertaV2Config(**SMALL, max_position_embeddings=128), True, ("post", "layer")),
    "phi": (transformers.PhiForCausalLM,
            lambda: transformers.PhiConfig(**SMALL, max_position_embeddings=128, bos_token_id=1, eos_token_id=2),
            False, ("parallel", "layer")),
}


def save_outside(name: str, path):
    model_class, config, encoder, _ = MODELS[name]
    torch.manual_seed(0)
    model_class(config()).save_pretrained(path)
    tiny_tokenizer(encoder).save_pretrained(path)
    if name == "mpnet":  # sentence-transformers' layout: the pooling beside the transformer
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


# mpnet and phi run end to end once each (the evaluated fixture); the graph test reads their
# placement from that run's FP32 export and exports only DeBERTa itself.
EVALUATED = ("mpnet", "phi")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A function: name -> (checkpoint directory, run directory) of its `quantnorm evaluate --model`
    run, made on first use (read only)."""
    root = tmp_path_factory.mktemp("outside")
    done = {}

    def run(name: str):
        if name not in done:
            path = save_outside(name, root / name)
            out = root / f"{name}-run"
            assert main(["evaluate", "--model", str(path), "--recipes", "dynamic,smoothquant,rotated-pertoken",
                         "--out", str(out), "--quiet", "--context", "16", "--eval-tokens", "48", "--calib-samples",
                         "4", "--batches", "1", "--iters", "2", "--latency-budget", "1", "--threads", "1",
                         "--no-outliers"]) == 0
            done[name] = (path, out)
        return done[name]

    return run


def test_the_table_does_not_know_them():
    assert not {"mpnet", "deberta-v2", "phi"} & set(ARCHITECTURES)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_graph_says_their_placement(name, tmp_path, evaluated):
    path = evaluated(name)[0] if name in EVALUATED else save_outside(name, tmp_path / name)
    files = inspect_checkpoint(path)
    assert files.spec.kind == ("encoder" if MODELS[name][2] else "causal")
    assert files.spec.placement == "detected" and not files.mlm_head
    loaded = load_checkpoint(path)
    assert len(loaded.layers) == 2 and loaded.placement_check["check"] == "none"
    if name in EVALUATED:
        out = evaluated(name)[1] / "model.fp32.onnx"   # the pipeline's export of it
    else:
        out = tmp_path / "m.onnx"
        export_hf_onnx(make_wrapper(loaded), out, np.random.default_rng(0).integers(5, 250, size=(2, 12)),
                       outputs=output_names(loaded.spec.kind), max_positions=128, opset=18)
    found = detect_placement(out)
    assert (found.placement, found.norm) == MODELS[name][3], found.how
    # post-norm encoders: one label per sublayer; Phi's attention and MLP share one add per block
    assert found.to_dict()["residual_adds"] == (4 if MODELS[name][2] else 2)
    assert found.final_norm == (not MODELS[name][2])


@pytest.mark.parametrize("name", EVALUATED)
def test_evaluate_model_runs_them_end_to_end(name, evaluated):
    _, out = evaluated(name)
    results = json.loads((out / "results.json").read_text())
    model = results["model"]
    expected = MODELS[name][3]
    assert model["architecture"] == name and "not in the loader table" in model["family"]
    assert model["kind"] == ("encoder" if MODELS[name][2] else "causal")
    assert (model["placement"], model["norm"]) == expected
    assert model["detected_from"] == GRAPH_DETECTED_FROM
    assert model["placement_detected"]["table"] is None
    assert model["placement_detected"]["how"].startswith("ONNX graph")
    status = {r["name"]: r["status"] for r in results["recipes"]}
    assert status["dynamic"] == "ok"
    for recipe, what in (("smoothquant", "SmoothQuant"), ("rotated-pertoken", "rotation")):
        assert status[recipe].startswith(NOT_APPLICABLE_PREFIX) and what in status[recipe], status[recipe]
        assert "fold rule" in status[recipe]
    report = (out / "report.md").read_text()
    assert GRAPH_DETECTED_FROM in report and f"**{expected[0]} / {expected[1]}**" in report
