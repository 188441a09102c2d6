"""The probe finds a planted massive activation: its block, position, channel, where it is born,
and which Linear inputs carry it (quantnorm.hf.probe)."""

from types import SimpleNamespace

import numpy as np
import torch
import transformers

from quantnorm.hf.loader import ARCHITECTURES
from quantnorm.hf.probe import probe_hf

BOS, CH_IN, HIDDEN_UNIT, CH_OUT = 1, 5, 7, 3


def planted_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=BOS)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # BOS alone carries channel CH_IN; block 1's MLP turns it into a huge value in CH_OUT
        # (gate and up read CH_IN, down writes CH_OUT): a massive activation born in layers.1.mlp.
        model.model.embed_tokens.weight[:, CH_IN] = 0.0
        model.model.embed_tokens.weight[BOS, CH_IN] = 1.0
        mlp = model.model.layers[1].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[HIDDEN_UNIT] = 0.0
            proj.weight[HIDDEN_UNIT, CH_IN] = 4.0
        mlp.down_proj.weight[:, HIDDEN_UNIT] = 0.0
        mlp.down_proj.weight[CH_OUT, HIDDEN_UNIT] = 30.0
    return model


def test_planted_massive_activation_is_found_where_it_is_born():
    model = planted_llama()
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"], layers=list(model.model.layers),
                             tokenizer=SimpleNamespace(convert_ids_to_tokens=lambda i: "<s>" if i == BOS else f"t{i}"))
    rng = np.random.default_rng(0)
    windows = rng.integers(2, 64, size=(4, 12))
    windows[:, 0] = BOS
    report, _ = probe_hf(loaded, windows, batch_size=2)
    massive = report["massive"]
    assert massive, "the planted value was not flagged"
    top = massive[0]
    assert (top["position"], top["channel"], top["token"]) == (0, CH_OUT, "<s>")
    assert top["layer"] in (1, 2) and abs(top["value"]) > 100 and top["ratio"] >= 1000
    born = report["massive_born"][0]
    assert (born["layer"], born["position"], born["channel"]) == (1, 0, CH_OUT)
    assert born["born_in"] == "layers.1.mlp.down_proj"
    # The down-projection input of block 1 carries it; the normalized attention inputs do not.
    rows = {r["tensor"]: r for r in report["matmul_inputs"]}
    assert rows["model.layers.1.mlp.down_proj"]["carries_massive"]
    assert not rows["model.layers.0.self_attn.q_proj"]["carries_massive"]
    # Per-token INT8 keeps that input far better than one scale for the whole tensor.
    fake = rows["model.layers.1.mlp.down_proj"]["sqnr_db_fake"]
    assert fake["per_token"] > fake["per_tensor_dynamic"] + 10


def test_fp16_check_names_a_planted_value_past_65504():
    from quantnorm.hf.fp16 import fp16_check

    model = planted_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[CH_OUT, HIDDEN_UNIT] = 3000.0  # the BOS value now > 65,504
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"], layers=list(model.model.layers))
    rng = np.random.default_rng(0)
    windows = rng.integers(2, 64, size=(2, 10))
    windows[:, 0] = BOS
    targets = np.roll(windows, -1, axis=1)
    report = fp16_check(loaded, windows, targets)
    names = [e["tensor"] for e in report["fp32_overflow"]]
    assert "block 1 output (residual stream)" in names and "model.layers.1.mlp.down_proj" in names
    block = next(e for e in report["fp32_overflow"] if e["tensor"] == "block 1 output (residual stream)")
    assert block["positions"] == [0] and block["max_abs"] > 65504
    assert report["verdict"].startswith("does not survive float16")
    assert report["forwards"]["float16"]["status"].startswith("overflows")
    assert report["forwards"]["bfloat16"]["status"] == "ok"


def test_fp16_check_passes_a_model_without_large_values():
    from quantnorm.hf.fp16 import fp16_check

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"], layers=list(model.model.layers))
    windows = np.random.default_rng(1).integers(0, 64, size=(2, 8))
    report = fp16_check(loaded, windows, np.roll(windows, -1, axis=1))
    assert report["fp32_overflow"] == [] and report["verdict"].startswith("survives float16")
    assert report["forwards"]["float16"]["status"] == "ok" and report["forwards"]["float16"]["kld_mean"] < 1e-3
