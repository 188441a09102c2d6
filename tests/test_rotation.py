"""Hadamard rotation of a Pre-RMSNorm checkpoint (quantnorm.transforms.rotation): exact in FP32, and it
shrinks per-token INT8 error where outlier channels are planted."""

import numpy as np
import pytest
import torch
import transformers

from quantnorm.errors import ConfigError
from quantnorm.quantize.pertoken import fake_quantize_rows
from quantnorm.sources.hf_loader import ARCHITECTURES
from quantnorm.transforms.rotation import (
    OnlineHadamard,
    hadamard,
    hadamard_factors,
    paley,
    rotate_wrapper,
    rotation_support,
    split_for_online,
)


class Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny_llama(d=48, ff=96, seed=0, plant=True):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=d, intermediate_size=ff, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial norm weights, so the fold is exercised
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
        if plant:
            # An outlier channel of the residual stream (every token), and one of the down-projection input.
            model.model.embed_tokens.weight[:, 7] = 0.5
            model.model.layers[0].mlp.up_proj.weight[11] *= 30.0
    return Wrapper(model).eval()


@pytest.mark.parametrize("n", [4, 12, 48, 576, 640, 1536])
def test_hadamard_is_orthonormal_with_flat_entries(n):
    h = hadamard(n)
    assert np.allclose(h @ h.T, np.eye(n), atol=1e-9)
    assert np.allclose(np.abs(h), 1 / np.sqrt(n))


def test_paley_and_factors():
    assert np.allclose(paley(11) @ paley(11).T, 12 * np.eye(12))
    assert hadamard_factors(576) == [48, 12] or np.prod(hadamard_factors(576)) == 576
    assert hadamard_factors(9) is None
    a, b = split_for_online(1536)
    assert a * b == 1536


@pytest.mark.parametrize("form", ["online", "block"])
def test_online_hadamard_is_the_matrix_it_reports(form):
    from quantnorm.transforms.rotation import BlockHadamard

    rot = OnlineHadamard(12, 8) if form == "online" else BlockHadamard(96, 32)
    h = torch.randn(3, 5, 96, dtype=torch.float32)
    m = rot.matrix()
    assert torch.allclose(m @ m.T, torch.eye(96, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(rot(h).double(), h.double() @ m, atol=1e-5)


def test_block_hadamard_rotates_inside_each_block_only():
    from quantnorm.errors import ConfigError
    from quantnorm.transforms.rotation import BlockHadamard, rotation_block

    m = BlockHadamard(96, 32).matrix()
    # block diagonal: a channel's energy stays in its own block of 32 (the block that owns its scale)
    blocks = torch.block_diag(*[torch.ones(32, 32, dtype=torch.float64)] * 3)
    assert (m[blocks == 0] == 0).all() and (m[blocks == 1].abs() > 0).all()
    with pytest.raises(ConfigError, match="multiples of 32, got 80"):
        BlockHadamard(80, 32)
    assert rotation_block("block32") == 32 and rotation_block("online") is None and rotation_block(None) is None


def test_rotation_is_exact_in_fp32():
    wrapper = tiny_llama()
    ids = torch.randint(0, 64, (2, 16))
    rotated, plan = rotate_wrapper(wrapper, ARCHITECTURES["llama"])
    with torch.no_grad():
        ref, got = wrapper(ids), rotated(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert plan.untied_head and plan.layers == 2 and len(plan.folded_norms) == 5
    # The original is untouched, and its head is still tied to the embedding.
    assert wrapper.model.lm_head.weight is wrapper.model.model.embed_tokens.weight


def per_token_input_error(wrapper, ids) -> float:
    """Worst relative error ||x - q(x)|| / ||x|| over the Linear inputs when each is quantized per
    token (the numpy reference of the per-token recipe)."""
    errors, handles = [], []

    def hook(module, args):
        x = args[0].detach().numpy()
        errors.append(float(np.linalg.norm(x - fake_quantize_rows(x)) / np.linalg.norm(x)))

    for module in wrapper.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            wrapper(ids)
    finally:
        for h in handles:
            h.remove()
    return max(errors)


def test_rotation_shrinks_per_token_error_of_planted_outlier_channels():
    # Its own generator: the global one's state depends on which tests ran before in the process.
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    planted, clean = tiny_llama(), tiny_llama(plant=False)
    plain_err = per_token_input_error(planted, ids)
    # the planted channels hurt INT8: about 2.1x the clean model's error for any ids (1.0: no harm)
    assert plain_err > 1.5 * per_token_input_error(clean, ids)
    rotated, _ = rotate_wrapper(planted, ARCHITECTURES["llama"])
    assert per_token_input_error(rotated, ids) < 0.5 * plain_err


def test_rotation_is_refused_where_it_does_not_apply():
    assert rotation_support(ARCHITECTURES["llama"]) is None
    assert "Peri-LN" in rotation_support(ARCHITECTURES["gemma3_text"])
    assert "Pre-RMSNorm" in rotation_support(ARCHITECTURES["bert"])
    with pytest.raises(ConfigError, match="rotation"):
        rotate_wrapper(tiny_llama(plant=False), ARCHITECTURES["gemma3_text"])


def tiny_gemma(seed=0):
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=40, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=64)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for norm in (m for m in model.modules() if type(m).__name__.endswith("RMSNorm")):
            norm.weight.uniform_(-0.5, 0.5)
        # An outlier channel in the normalized MLP input of block 0 (a stand-in for Gemma's own).
        model.model.layers[0].pre_feedforward_layernorm.weight[3] = 100.0
    return Wrapper(model).eval()


def test_online_rotation_is_exact_for_peri_ln_and_shrinks_per_token_error():
    from quantnorm.transforms.rotation import rotate_linear_inputs

    wrapper = tiny_gemma()
    ids = torch.randint(0, 64, (2, 16))
    rotated, plan = rotate_linear_inputs(wrapper, ARCHITECTURES["gemma3_text"])
    with torch.no_grad():
        ref, got = wrapper(ids), rotated(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert plan.untied_head and "Linear" in plan.online
    assert per_token_input_error(rotated, ids) < 0.5 * per_token_input_error(wrapper, ids)


def test_online_rotation_unties_an_mlm_decoder_tied_to_the_embedding():
    """BERT's MLM decoder (not an ``lm_head``) shares its weight with the token embedding: form (b)
    rotates the decoder's own copy, and the model still computes its logits."""
    from quantnorm.transforms.rotation import rotate_linear_inputs

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    wrapper = Wrapper(model).eval()
    ids = torch.randint(0, 64, (2, 16))
    rotated, plan = rotate_linear_inputs(wrapper, ARCHITECTURES["bert"])
    with torch.no_grad():
        ref, got = wrapper(ids), rotated(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert plan.untied_head
    assert torch.equal(rotated.model.get_input_embeddings().weight, model.get_input_embeddings().weight)


# --- form (b) on the zoo (claim 13 on the zoo models) -----------------------------------------


@pytest.mark.parametrize("placement", ["post", "pre", "peri", "deepnorm", "residual"])
def test_zoo_online_rotation_is_exact_for_every_placement_and_keeps_the_hadamards_fp32(tmp_path, placement):
    import onnx

    from quantnorm.models import CausalLM, ModelConfig
    from quantnorm.quantize import get_recipe, quantize
    from quantnorm.transforms.rotation import export_online_rotated

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement=placement, norm="rms", n_layers=2, d_model=32, n_heads=2,
                                 context=16)).eval()
    ids = np.random.default_rng(0).integers(0, 256, size=(3, 16))
    out = export_online_rotated(model, ids, tmp_path / "rot.onnx", opset=18)
    assert out.onnx_vs_original_max_rel_diff < 1e-5 and out.path.is_file()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert f"({linears} Linears" in out.plan.online and out.to_dict()["path"] == "rot.onnx"
    q = quantize(out.path, get_recipe("online-rotated-pertoken-fused"), ids, tmp_path / "int8.onnx", vnni=True,
                 probe_inputs=ids[:2])
    assert q.status == "ok", q.problems
    graph = onnx.load(str(q.path)).graph
    quantized = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat"]
    online = [n for n in graph.node if n.op_type == "MatMul" and "online_hadamard" in n.name]
    # every Linear is INT8; the Hadamards stay FP32 MatMuls
    assert len(quantized) == linears and online and not any("online_hadamard" in n.name for n in quantized)
    # q, k and v read one tensor: the export computes its rotation once (onnx_simplify) and the
    # per-token rewrite quantizes it once, so each block quantizes 4 inputs for its 6 Linears
    blocks = 2
    assert len(online) == 2 * (4 * blocks + 1)   # two MatMuls per rotation: q/k/v, proj, up, down; the head
    assert sum(n.op_type == "QuantizeLinear" for n in graph.node) == 4 * blocks + 1


def test_zoo_block_rotation_is_exact_with_one_fp32_matmul_per_rotated_input(tmp_path, placement="peri"):
    import onnx

    from quantnorm.errors import ConfigError
    from quantnorm.models import CausalLM, ModelConfig
    from quantnorm.quantize import get_recipe, quantize
    from quantnorm.transforms.rotation import export_online_rotated, rotate_every_linear_input

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement=placement, norm="rms", n_layers=2, d_model=32, n_heads=2,
                                 context=16)).eval()
    ids = np.random.default_rng(0).integers(0, 256, size=(3, 16))
    out = export_online_rotated(model, ids, tmp_path / "rot.onnx", opset=18, block=16)
    assert out.onnx_vs_original_max_rel_diff < 1e-5
    assert "inside each block of 16" in out.plan.online and "32=2x16" in out.plan.online
    q = quantize(out.path, get_recipe("block-rotated-wo-int8-b16-acc4"), ids, tmp_path / "int8.onnx", vnni=True,
                 probe_inputs=ids[:2])
    assert q.status == "ok", q.problems
    graph = onnx.load(str(q.path)).graph
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    rotations = [n for n in graph.node if n.op_type == "MatMul" and "online_hadamard" in n.name]
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == linears
    # one MatMul per rotated input (q/k/v share theirs), no transpose: 4 per block and the head's
    assert len(rotations) == 4 * 2 + 1 and not any(n.op_type == "Transpose" and "online_hadamard" in n.name
                                                   for n in graph.node)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match="multiple of 64"):
        rotate_every_linear_input(model, 64)   # d_model 32: refused before any weight changed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_zoo_online_rotation_shrinks_per_token_error_of_a_planted_outlier_channel():
    from quantnorm.models import CausalLM, ModelConfig
    from quantnorm.transforms.rotation import rotate_every_linear_input

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=2, d_model=32, n_heads=2, context=16)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.up.weight[5] *= 40.0  # one channel of every down-projection input stands out
    ids = torch.randint(0, 256, (2, 16))
    rotated = __import__("copy").deepcopy(model)
    rotate_every_linear_input(rotated)
    with torch.no_grad():
        assert (rotated(ids) - model(ids)).abs().max() / model(ids).abs().max() < 1e-5
    assert per_token_input_error(rotated, ids) < 0.5 * per_token_input_error(model, ids)


def test_a_failed_transformed_export_is_tried_once_and_a_refusal_every_time(tmp_path):
    """FP32Variants: an export that fails its parity gate fails the same way for every recipe of its
    form (the search asks once per recipe), so it runs once and later recipes get its error; a
    refusal (ConfigError) costs nothing and is asked again, naming the recipe that asked."""
    from types import SimpleNamespace

    from quantnorm.errors import ExportError
    from quantnorm.transforms.variants import FP32Variants

    calls = []

    def rotate(recipe):
        calls.append(recipe.name)
        if recipe.rotation == "online":
            raise ExportError("rotated ONNX model does not match the original model")
        raise ConfigError(f"recipe {recipe.name}: no stream rotation here")

    def smooth(alpha, path):
        calls.append(alpha)
        raise ExportError("smoothed ONNX model does not match the original model")

    variants = FP32Variants(tmp_path, rotate=rotate, smooth=smooth)
    def recipe(name, **kw):
        return SimpleNamespace(**{"name": name, "rotation": None, "smoothquant_alpha": None, **kw})

    for name in ("online-a", "online-b"):
        with pytest.raises(ExportError, match="does not match"):
            variants.fp32_for(recipe(name, rotation="online"), tmp_path / "plain.onnx")
    for name in ("stream-a", "stream-b"):
        with pytest.raises(ConfigError, match=f"recipe {name}:"):
            variants.fp32_for(recipe(name, rotation="hadamard"), tmp_path / "plain.onnx")
    for _ in range(2):
        with pytest.raises(ExportError, match="smoothed"):
            variants.fp32_for(recipe("sq", smoothquant_alpha=0.5), tmp_path / "plain.onnx")
    assert calls == ["online-a", "stream-a", "stream-b", 0.5]
    assert not variants.rotated and not variants.exports
    assert variants.fp32_for(recipe("plain"), tmp_path / "plain.onnx") == tmp_path / "plain.onnx"


def test_rotations_transform_weights_a_block_of_rows_at_a_time(monkeypatch):
    """A large head is rotated by blocks of rows (no whole float64 copy beside it): with blocks of
    5 rows (the 64-row head and embedding in 13 blocks, the last one short) both forms give the
    weights of the whole-matrix computation, and the rotated model stays exact."""
    from quantnorm.transforms import rotation
    from quantnorm.transforms.rotation import by_row_blocks, rotate_linear_inputs

    weight = torch.randn(23, 8)
    scale = torch.rand(8, dtype=torch.float64) + 0.5
    monkeypatch.setattr(rotation, "ROW_BLOCK", 5)
    got = by_row_blocks(weight, lambda rows: rows * scale[None, :])
    assert got.dtype == torch.float32 and got.shape == weight.shape
    assert torch.allclose(got, (weight.double() * scale[None, :]).float(), rtol=1e-6, atol=0)

    ids = torch.randint(0, 64, (2, 16))
    for rotate, model in ((lambda w: rotate_wrapper(w, ARCHITECTURES["llama"]), tiny_llama()),
                          (lambda w: rotate_linear_inputs(w, ARCHITECTURES["gemma3_text"]), tiny_gemma())):
        monkeypatch.setattr(rotation, "ROW_BLOCK", 5)
        blocked, _ = rotate(model)
        monkeypatch.setattr(rotation, "ROW_BLOCK", 1 << 20)
        whole, _ = rotate(model)
        for (name, a), (_, b) in zip(blocked.state_dict().items(), whole.state_dict().items()):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), name
        with torch.no_grad():
            ref, got = model(ids), blocked(ids)
        assert (got - ref).abs().max() / ref.abs().max() < 1e-4


def test_stream_block_rotation_is_exact_and_rotates_the_values_with_no_operator():
    # Form (d): the stream rotated as form (a), the down input inside blocks of 16, each head's
    # values inside blocks of 16 folded into v_proj and o_proj (head_dim 16, grouped heads 4/2).
    from quantnorm.transforms.rotation import BlockHadamard, RotatedInput, rotated_copy, stream_rotation_block

    wrapper = tiny_llama(d=64, ff=96)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    class Loaded:
        spec = ARCHITECTURES["llama"]

    rotated, plan = rotated_copy(Loaded, wrapper, "stream-block16")
    with torch.no_grad():
        ref, got = wrapper(ids), rotated(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert "each block of 16 of every head's values" in plan.online
    layer = rotated.model.model.layers[0]
    # one operator per layer in the graph: the down input's block rotation; q/k/v/o/gate/up are plain Linears
    assert isinstance(layer.mlp.down_proj, RotatedInput) and isinstance(layer.mlp.down_proj.online_hadamard,
                                                                          BlockHadamard)
    assert all(isinstance(lin, torch.nn.Linear) for lin in (layer.self_attn.v_proj, layer.self_attn.o_proj))
    # the values are the stream-rotated model's values, rotated inside each head's blocks of 16
    plain, _ = rotated_copy(Loaded, wrapper, "hadamard")
    m = BlockHadamard(32, 16).matrix().float()
    v_plain, v_block = plain.model.model.layers[0].self_attn.v_proj.weight, layer.self_attn.v_proj.weight
    assert torch.allclose(v_block, m.T @ v_plain, atol=1e-5) and not torch.allclose(v_block, v_plain, atol=1e-3)
    assert stream_rotation_block("stream-block16") == 16 and stream_rotation_block("block16") is None
    # a block that straddles two heads (head_dim 16) or does not divide the down input is refused, naming why
    for form, why in (("stream-block32", "divides the head dimension"), ("stream-block12", "power-of-two")):
        with pytest.raises(ConfigError, match=why):
            rotated_copy(Loaded, wrapper, form)
