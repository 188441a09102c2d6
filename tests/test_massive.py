"""The probe finds a planted massive activation: its block, position, channel, where it is born,
and which Linear inputs carry it (quantnorm.measure.graph_probe, on the exported graph)."""

from types import SimpleNamespace

import numpy as np
import torch
import transformers

from quantnorm.measure.graph_probe import graph_probe
from quantnorm.sources.hf_export import export_hf_onnx, make_wrapper
from quantnorm.sources.hf_loader import ARCHITECTURES

BOS, CH_IN, HIDDEN_UNIT, CH_OUT = 1, 5, 7, 3


def planted_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=BOS, attn_implementation="eager")
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


def test_planted_massive_activation_is_found_where_it_is_born(tmp_path):
    model = planted_llama()

    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"],
                             files=SimpleNamespace(pooling="mean", mlm_head=False))
    path = tmp_path / "planted.onnx"
    # the pipeline's own export (dynamo first), so the graph is the one evaluate probes
    export_hf_onnx(make_wrapper(loaded), path, np.full((2, 12), 3), outputs=("logits",), max_positions=64)
    rng = np.random.default_rng(0)
    windows = rng.integers(2, 64, size=(4, 12))
    windows[:, 0] = BOS
    report, _ = graph_probe(path, windows, n_blocks=3, batch_size=2,
                            token=lambda sample, position: "<s>" if windows[sample, position] == BOS else "t")
    massive = report["massive"]
    assert massive, "the planted value was not flagged"
    top = massive[0]
    assert (top["position"], top["channel"], top["token"]) == (0, CH_OUT, "<s>")
    assert top["layer"] in (1, 2) and abs(top["value"]) > 100 and top["ratio"] >= 1000
    born = report["massive_born"][0]
    assert (born["layer"], born["position"], born["channel"]) == (1, 0, CH_OUT)
    assert born["born_in"] == "block 1 mlp"  # the second residual add of block 1 made it
    # The down-projection input of block 1 carries it; the normalized attention inputs do not.
    rows = {m: r for r in report["matmul_inputs"] for m in r["modules"]}
    down = next(r for m, r in rows.items() if "layers.1.mlp.down_proj/" in m)
    q0 = next(r for m, r in rows.items() if "layers.0.self_attn.q_proj/" in m)
    assert down["carries_massive"] and not q0["carries_massive"]
    # Per-token INT8 keeps that input far better than one scale for the whole tensor.
    assert down["sqnr_db_fake"]["per_token"] > down["sqnr_db_fake"]["per_tensor_dynamic"] + 10
    # The attention probabilities are found (one Softmax per block), and BOS gets a real share.
    assert len(report["bos_attention"]) == 3 and all(0 < a < 1 for a in report["bos_attention"])


def test_fp16_check_names_a_planted_value_past_65504():
    from quantnorm.measure.fp16_check import fp16_check

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
    from quantnorm.measure.fp16_check import fp16_check

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"], layers=list(model.model.layers))
    windows = np.random.default_rng(1).integers(0, 64, size=(2, 8))
    report = fp16_check(loaded, windows, np.roll(windows, -1, axis=1))
    assert report["fp32_overflow"] == [] and report["verdict"].startswith("survives float16")
    assert report["forwards"]["float16"]["status"] == "ok" and report["forwards"]["float16"]["kld_mean"] < 1e-3


def test_fp16_check_fp32_residual_fix_survives_a_stream_that_only_the_sum_overflows():
    """Blocks 1 and 2 each add about 40,000 to one channel on BOS: every sublayer output fits float16,
    their sum (the residual stream, ~80,000) does not. Pure float16 overflows; float16 compute with a
    float32 residual stream stays finite and close to FP32."""
    from quantnorm.measure.fp16_check import FP32_RESIDUAL, fp16_check

    model = planted_llama()
    layers = model.model.layers
    rng = np.random.default_rng(0)
    windows = rng.integers(2, 64, size=(2, 10))
    windows[:, 0] = BOS
    ids = torch.from_numpy(windows)

    def norm_input_rms_and_down(block):
        seen = {}
        # (a hook that returns a value replaces the output: these return None)
        h1 = layers[block].post_attention_layernorm.register_forward_hook(
            lambda m, a, o: seen.__setitem__("rms", float(a[0][0, 0].pow(2).mean().sqrt())))
        h2 = layers[block].mlp.down_proj.register_forward_hook(
            lambda m, a, o: seen.__setitem__("down", float(o[0, 0, CH_OUT])))
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        h1.remove(), h2.remove()
        return seen

    with torch.no_grad():
        for layer in layers:   # nothing writes CH_IN: it stays the embedding's (1 on BOS, 0 elsewhere)
            layer.self_attn.o_proj.weight[CH_IN] = 0.0
            layer.mlp.down_proj.weight[CH_IN] = 0.0
        first = norm_input_rms_and_down(1)
        layers[1].mlp.down_proj.weight[CH_OUT, HIDDEN_UNIT] *= 40000.0 / first["down"]
        second_mlp = layers[2].mlp
        second_mlp.load_state_dict(layers[1].mlp.state_dict())
        rms2 = norm_input_rms_and_down(2)["rms"]
        # block 2's norm sees CH_IN scaled down by the 40,000 in the stream: its weight gives it back
        layers[2].post_attention_layernorm.weight[CH_IN] = rms2 / first["rms"]
    added = norm_input_rms_and_down(2)["down"]
    assert 30000 < added < 60000
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"], layers=list(layers))
    report = fp16_check(loaded, windows, np.roll(windows, -1, axis=1))
    over = {e["tensor"]: e for e in report["fp32_overflow"]}
    assert "block 2 output (residual stream)" in over and "model.layers.2.mlp.down_proj" not in over
    assert report["forwards"]["float16"]["status"].startswith("overflows")
    fixed = report["forwards"][FP32_RESIDUAL]
    assert fixed["status"] == "ok" and fixed["top1_agreement"] > 0.9, fixed


def test_carrier_recipes_keep_or_per_token_the_matmuls_the_probe_finds(tmp_path):
    """static-minmax-matmul-carriers-*: the probe (on calibration windows) finds block 1's
    down-projection input carrying the planted value; -fp32 leaves that MatMul in FP32, -pertoken
    quantizes it per token, every other weight MatMul is static QDQ in both."""
    import onnx

    from quantnorm.quantize import get_recipe, quantize

    model = planted_llama()
    loaded = SimpleNamespace(model=model, spec=ARCHITECTURES["llama"],
                             files=SimpleNamespace(pooling="mean", mlm_head=False))
    path = tmp_path / "planted.onnx"
    export_hf_onnx(make_wrapper(loaded), path, np.full((2, 12), 3), outputs=("logits",), max_positions=64)
    calib = np.random.default_rng(1).integers(2, 64, size=(8, 12))
    calib[:, 0] = BOS
    results = {}
    for name in ("static-minmax-matmul-carriers-fp32", "static-minmax-matmul-carriers-pertoken"):
        q = quantize(path, get_recipe(name), calib, tmp_path / f"{name}.onnx", vnni=True, probe_inputs=calib[:2])
        assert q.status == "ok", q.problems
        found = q.settings["carriers_found"]
        assert any("layers.1.mlp.down_proj" in n for n in found["nodes"]), found
        assert all(abs(i["max_abs"]) > 100 and i["position"] == 0 for i in found["inputs"])
        results[name] = (q, onnx.load(str(q.path)).graph)
    _, fp32_graph = results["static-minmax-matmul-carriers-fp32"]
    producers = {o: n.op_type for n in fp32_graph.node for o in n.output}
    down = next(n for n in fp32_graph.node if n.op_type == "MatMul" and "layers.1.mlp.down_proj" in n.name)
    assert all(producers.get(i) != "DequantizeLinear" for i in down.input)   # FP32 inputs and weight
    q_proj = next(n for n in fp32_graph.node if n.op_type == "MatMul" and "layers.1.self_attn.q_proj" in n.name)
    assert any(producers.get(i) == "DequantizeLinear" for i in q_proj.input)  # the rest: static QDQ
    q, pt_graph = results["static-minmax-matmul-carriers-pertoken"]
    fused = [n.name for n in pt_graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert fused and all("down_proj" in n for n in fused) and q.settings["carriers_pertoken"]["pertoken_matmuls"]
