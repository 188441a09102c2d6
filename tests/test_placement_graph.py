"""Placement and norm read from the exported ONNX graph (quantnorm.measure.placement), checked on
tiny models of every family in the loader table, on one outside it (GPT-NeoX, parallel blocks),
and on the zoo's own placements."""

import numpy as np
import pytest
import torch
import transformers

from quantnorm.measure.placement import detect_placement
from quantnorm.sources.hf_export import export_hf_onnx

EXPECTED = {"gpt2": ("pre", "layer"), "llama": ("pre", "rms"), "qwen2": ("pre", "rms"),
            "gemma3_text": ("peri", "rms"), "olmo2": ("output-norm", "rms"), "bert": ("post", "layer")}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_detected_from_the_graph_matches_the_table(name, hf_exported):
    out, result, _ = hf_exported(name)   # the session's export of tests/test_hf.py's tiny checkpoint
    assert result.opset == 18
    found = detect_placement(out)
    assert (found.placement, found.norm) == EXPECTED[name], found.how
    assert found.to_dict()["residual_adds"] == 4  # 2 blocks x (attention, MLP)
    assert found.final_norm == (name != "bert")


def test_a_family_outside_the_table_is_classified_parallel(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=True)
    model = transformers.GPTNeoXForCausalLM(config).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    out = tmp_path / "neox.onnx"
    export_hf_onnx(Wrapper(model).eval(), out, np.random.default_rng(0).integers(0, 64, size=(2, 10)),
                   outputs=("logits",), max_positions=64, opset=18)
    found = detect_placement(out)
    assert (found.placement, found.norm) == ("parallel", "layer"), found.how


@pytest.mark.parametrize("placement", ["pre", "post", "peri", "deepnorm", "residual"])
def test_zoo_placements(placement, zoo_exported):
    model, out = zoo_exported(placement)   # the session's export (tests/conftest.py; both norms over the five)
    found = detect_placement(out)
    assert (found.placement, found.norm) == (placement, model.cfg.norm), found.how
    assert len(found.taps) == 4 and bool(found.skips) == (placement == "residual")  # ResiDual's x_d found


def test_an_architecture_outside_the_table_is_evaluated_with_its_detected_placement(tmp_path):
    from test_hf import tiny_tokenizer

    from quantnorm.evaluate import EvaluateConfig, evaluate
    from quantnorm.sources import HFOptions, HFSource

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=128,
                                        use_parallel_residual=True, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "neox"
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    tiny_tokenizer(False).save_pretrained(path)
    cfg = EvaluateConfig(recipes=("pertoken",), providers=("cpu",), calib_samples=4, latency_batches=(1,),
                         latency_iters=2, latency_warmup=1, probe_windows=2, parity_windows=2, progress=False,
                         threads=1)
    results = evaluate(HFSource(HFOptions(path=path, window=16, max_eval_windows=4, out_dir=tmp_path / "run")), cfg,
                       command="test")
    model = results["model"]
    assert model["architecture"] == "gpt_neox" and "not in the loader table" in model["family"]
    assert (model["placement"], model["norm"]) == ("parallel", "layer")
    assert model["placement_detected"]["how"].startswith("ONNX graph")
    assert results["recipes"][0]["status"] == "ok"
