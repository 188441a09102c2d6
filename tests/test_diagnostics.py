import numpy as np
import pytest
import torch

from quantnorm.measure.diagnostics import block_output_similarity, perturbation_sensitivity
from quantnorm.models import CausalLM, ModelConfig

INPUTS = np.random.default_rng(0).integers(0, 256, size=(4, 16)).astype(np.int64)


def tiny(placement="pre"):
    torch.manual_seed(0)
    return CausalLM(ModelConfig(placement=placement, norm="layer", n_layers=2, d_model=32, n_heads=2, context=16))


def test_perturbation_grows_with_noise_and_is_zero_without():
    rows = perturbation_sensitivity(tiny(), INPUTS, noise_levels=(0.0, 1e-3, 1e-1), repeats=2)
    changes = [r["relative_logit_change"] for r in rows]
    assert changes[0] == 0.0
    assert 0 < changes[1] < changes[2]
    # for small noise the response is about linear in the noise level
    small = perturbation_sensitivity(tiny(), INPUTS, noise_levels=(1e-4, 1e-3), repeats=2)
    ratio = small[1]["relative_logit_change"] / small[0]["relative_logit_change"]
    assert ratio == pytest.approx(10, rel=0.2)


def test_perturbation_leaves_the_model_untouched():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    perturbation_sensitivity(model, INPUTS, noise_levels=(0.5,), repeats=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_block_cosine_against_hand_computation():
    model = tiny("pre")
    got = block_output_similarity(model, INPUTS, batch_size=3)
    x = torch.from_numpy(INPUTS)
    with torch.no_grad():
        h = (model.embed(x),)
        want = []
        for block in model.blocks:
            out = block(h)
            want.append(float(torch.nn.functional.cosine_similarity(h[0], out[0], dim=-1).mean()))
            h = out
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_identity_blocks_have_cosine_one():
    model = tiny("pre")
    for block in model.blocks:  # zero the sublayer outputs: pre-LN blocks become the identity
        block.attn.proj.weight.data.zero_()
        block.attn.proj.bias.data.zero_()
        block.mlp.down.weight.data.zero_()
        block.mlp.down.bias.data.zero_()
    np.testing.assert_allclose(block_output_similarity(model, INPUTS), [1.0, 1.0], rtol=1e-5)
