"""Placement and norm read from the exported ONNX graph (quantnorm.measure.placement), checked on
tiny models of every family in the loader table, on one outside it (GPT-NeoX, parallel blocks),
and on the zoo's own placements."""

import pytest
import torch
import transformers

from quantnorm.measure.placement import detect_placement

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


@pytest.fixture(scope="module")
def neox_run(tmp_path_factory):
    """A tiny GPT-NeoX (parallel attention and MLP, a family outside the loader table) evaluated
    once through the one pipeline: (results, run directory holding its FP32 export)."""
    from test_hf import tiny_tokenizer

    from quantnorm.evaluate import EvaluateConfig, evaluate
    from quantnorm.sources import HFOptions, HFSource

    root = tmp_path_factory.mktemp("neox")
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=128,
                                        use_parallel_residual=True, bos_token_id=1, eos_token_id=2)
    path = root / "neox"
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    tiny_tokenizer(False).save_pretrained(path)
    cfg = EvaluateConfig(recipes=("pertoken",), providers=("cpu",), calib_samples=4, latency_batches=(1,),
                         latency_iters=2, latency_warmup=1, probe_windows=2, parity_windows=2, progress=False,
                         threads=1)
    source = HFSource(HFOptions(path=path, window=16, max_eval_windows=4, out_dir=root / "run"))
    return evaluate(source, cfg, command="test"), source.run_dir


def test_a_family_outside_the_table_is_classified_parallel(neox_run):
    _, run_dir = neox_run
    found = detect_placement(run_dir / "model.fp32.onnx")   # its export, read here on its own
    assert (found.placement, found.norm) == ("parallel", "layer"), found.how
    assert found.to_dict()["residual_adds"] == 2   # one add per block: attention and MLP share it


@pytest.mark.parametrize("placement", ["pre", "post", "peri", "deepnorm", "residual"])
def test_zoo_placements(placement, zoo_exported):
    model, out = zoo_exported(placement)   # the session's export (tests/conftest.py; both norms over the five)
    found = detect_placement(out)
    assert (found.placement, found.norm) == (placement, model.cfg.norm), found.how
    assert len(found.taps) == 4 and bool(found.skips) == (placement == "residual")  # ResiDual's x_d found


def test_an_architecture_outside_the_table_is_evaluated_with_its_detected_placement(neox_run):
    results, _ = neox_run
    model = results["model"]
    assert model["architecture"] == "gpt_neox" and "not in the loader table" in model["family"]
    assert (model["placement"], model["norm"]) == ("parallel", "layer")
    assert model["placement_detected"]["how"].startswith("ONNX graph")
    assert results["recipes"][0]["status"] == "ok"
