"""Each placement and norm against a hand-written reference of its formula (FORMULAS.md).

The references below share no code with quantnorm.models: they re-implement the norms, the
attention (with the textbook -inf causal mask) and the MLP from the raw weights.
"""

import math

import pytest
import torch

from quantnorm.errors import ConfigError
from quantnorm.models import (
    NORMS,
    PLACEMENTS,
    Block,
    CausalLM,
    LayerNorm,
    ModelConfig,
    RMSNorm,
    deepnorm_beta,
    masked_softmax,
)

torch.manual_seed(0)


def ref_layer_norm(x, norm):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    return norm.weight * (x - mean) / torch.sqrt(var + norm.eps) + norm.bias


def ref_rms_norm(x, norm):
    return norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps)


def ref_norm(x, norm):
    return ref_layer_norm(x, norm) if isinstance(norm, LayerNorm) else ref_rms_norm(x, norm)


def ref_linear(x, lin):
    return x @ lin.weight.T + lin.bias


def ref_attention(x, attn):
    B, T, C = x.shape
    H = attn.n_heads
    D = C // H
    q = ref_linear(x, attn.q).view(B, T, H, D).permute(0, 2, 1, 3)
    k = ref_linear(x, attn.k).view(B, T, H, D).permute(0, 2, 1, 3)
    v = ref_linear(x, attn.v).view(B, T, H, D).permute(0, 2, 1, 3)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    y = torch.einsum("bhqk,bhkd->bhqd", probs, v).permute(0, 2, 1, 3).reshape(B, T, C)
    return ref_linear(y, attn.proj)


def ref_mlp(x, mlp):
    h = ref_linear(x, mlp.up)
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return ref_linear(h, mlp.down)


def ref_block(placement, block, stream, n_layers):
    """The rules of FORMULAS.md, written out per placement."""
    F_attn = lambda t: ref_attention(t, block.attn)  # noqa: E731
    F_mlp = lambda t: ref_mlp(t, block.mlp)  # noqa: E731
    alpha = (2 * n_layers) ** 0.25
    for F, norms in ((F_attn, block.attn_norms), (F_mlp, block.mlp_norms)):
        if placement == "post":
            (x,) = stream
            stream = (ref_norm(x + F(x), norms["norm"]),)
        elif placement == "pre":
            (x,) = stream
            stream = (x + F(ref_norm(x, norms["norm"])),)
        elif placement == "peri":
            (x,) = stream
            stream = (x + ref_norm(F(ref_norm(x, norms["norm_in"])), norms["norm_out"]),)
        elif placement == "deepnorm":
            (x,) = stream
            stream = (ref_norm(alpha * x + F(x), norms["norm"]),)
        elif placement == "residual":
            x_a, x_d = stream
            f = F(x_a)
            stream = (ref_norm(x_a + f, norms["norm"]), x_d + f)
    return stream


def randomize_norms(module):
    """Norm weights start at 1/0; give them random values so a swapped gamma/beta would show."""
    for m in module.modules():
        if isinstance(m, (LayerNorm, RMSNorm)):
            m.weight.data = torch.randn_like(m.weight) * 0.5 + 1
            if m.bias is not None:
                m.bias.data = torch.randn_like(m.bias) * 0.1


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_block_matches_reference(placement, norm):
    cfg = ModelConfig(placement=placement, norm=norm, n_layers=3, d_model=32, n_heads=4, context=16)
    block = Block(cfg)
    randomize_norms(block)
    for m in block.modules():
        if isinstance(m, torch.nn.Linear):
            m.bias.data = torch.randn_like(m.bias) * 0.1  # biases start at zero; make them count
    n_streams = PLACEMENTS[placement].n_streams
    stream = tuple(torch.randn(2, 11, 32) for _ in range(n_streams))
    got = block(stream)
    want = ref_block(placement, block, stream, cfg.n_layers)
    assert len(got) == len(want) == n_streams
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_model_readout_and_final_norm(placement):
    cfg = ModelConfig(placement=placement, norm="layer", n_layers=2, d_model=32, n_heads=2, context=16)
    model = CausalLM(cfg)
    randomize_norms(model)
    ids = torch.randint(0, 257, (2, 9))
    x = model.tok_emb.weight[ids] + model.pos_emb.weight[:9][None]
    stream = (x, x) if placement == "residual" else (x,)
    for block in model.blocks:
        stream = ref_block(placement, block, stream, cfg.n_layers)
    if placement == "residual":
        hidden = stream[0] + ref_norm(stream[1], model.final_norm)  # x_a + N_final(x_d)
    elif placement in ("pre", "peri"):
        hidden = ref_norm(stream[0], model.final_norm)
    else:
        assert model.final_norm is None  # post and deepnorm have no final norm
        hidden = stream[0]
    torch.testing.assert_close(model(ids), hidden @ model.head.weight.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_kv_cache_gives_the_whole_windows_logits(placement):
    """A prompt after an empty past, then one token at a time against the cache: the same logits
    as the whole window (positions continue from the past), for every placement."""
    cfg = ModelConfig(placement=placement, norm="layer", n_layers=2, d_model=32, n_heads=4, context=16)
    model = CausalLM(cfg).eval()
    randomize_norms(model)
    ids = torch.randint(0, 257, (3, 12))
    with torch.no_grad():
        whole = model(ids)
        logits, past = model.forward_with_past(ids[:, :5])
        steps = [logits]
        for t in range(5, 12):
            logits, past = model.forward_with_past(ids[:, t:t + 1], past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-5)
    assert len(past) == cfg.n_layers
    assert all(k.shape == v.shape == (3, 4, 12, 8) for k, v in past)


def test_the_kv_cache_honours_padding_and_position_ids():
    """A left-padded row (mask 0 on the pads, positions from its first real token) gives the
    logits of the same tokens alone, before and after a cached step."""
    model = CausalLM(ModelConfig(placement="pre", n_layers=2, d_model=32, n_heads=4, context=16)).eval()
    real = torch.randint(0, 257, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.int64), real], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 6])
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    nxt = torch.randint(0, 257, (1, 1))
    with torch.no_grad():
        want = model(torch.cat([real, nxt], dim=1))
        got, past = model.forward_with_past(padded, position_ids=positions, attention_mask=mask)
        step, _ = model.forward_with_past(nxt, past, position_ids=torch.tensor([[6]]),
                                          attention_mask=torch.cat([mask, torch.ones(1, 1, dtype=torch.int64)], 1))
    torch.testing.assert_close(got[:, 3:], want[:, :6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step, want[:, 6:], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got).all()  # the padded queries see only themselves: no 0/0


@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm])
def test_norm_formulas(norm_cls):
    norm = norm_cls(24)
    randomize_norms(norm)
    x = torch.randn(5, 7, 24) * 3 + 1
    torch.testing.assert_close(norm(x), ref_norm(x, norm), rtol=1e-5, atol=1e-5)
    if norm_cls is LayerNorm:  # zero mean, unit variance before the affine part
        norm.weight.data.fill_(1.0)
        norm.bias.data.zero_()
        y = norm(x)
        torch.testing.assert_close(y.mean(-1), torch.zeros(5, 7), atol=1e-5, rtol=0)
    else:
        assert norm.bias is None


def test_masked_softmax_equals_softmax_over_allowed_keys():
    scores = torch.randn(3, 2, 10, 10) * 20
    keep = torch.tril(torch.ones(10, 10))
    want = torch.softmax(scores.masked_fill(keep == 0, float("-inf")), dim=-1)
    torch.testing.assert_close(masked_softmax(scores, keep), want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(masked_softmax(scores * 100, keep)).all()


def test_deepnorm_alpha_beta_and_init_gains():
    L = 6
    cfg = ModelConfig(placement="deepnorm", norm="layer", n_layers=L, d_model=256, n_heads=4, context=16)
    model = CausalLM(cfg)
    assert model.blocks[0].alpha == pytest.approx((2 * L) ** 0.25)
    assert deepnorm_beta(L) == pytest.approx((8 * L) ** -0.25)
    block = model.blocks[0]

    def xavier_std(lin, gain):
        fan_out, fan_in = lin.weight.shape
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    beta = deepnorm_beta(L)
    for lin in (block.mlp.up, block.mlp.down, block.attn.v, block.attn.proj):
        assert lin.weight.std().item() == pytest.approx(xavier_std(lin, beta), rel=0.05)
    for lin in (block.attn.q, block.attn.k):
        assert lin.weight.std().item() == pytest.approx(xavier_std(lin, 1.0), rel=0.05)
    # other placements: skip weight 1 and GPT-2 init
    pre = CausalLM(ModelConfig(placement="pre", norm="layer", n_layers=L, d_model=256, n_heads=4, context=16))
    assert pre.blocks[0].alpha == 1.0
    assert pre.blocks[0].attn.v.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_residual_keeps_an_unnormalized_stream():
    cfg = ModelConfig(placement="residual", norm="rms", n_layers=2, d_model=32, n_heads=2, context=16)
    block = CausalLM(cfg).blocks[0]
    x = torch.randn(1, 5, 32) * 10
    x_a, x_d = block((x, x))
    f_attn = block.attn(x)
    x_a1 = block.attn_norms["norm"](x + f_attn)
    f_mlp = block.mlp(x_a1)
    # x_d accumulates both sublayer outputs without any norm: x_d = x + F_attn + F_mlp
    torch.testing.assert_close(x_d, x + f_attn + f_mlp, rtol=1e-5, atol=1e-5)
    assert x_d.pow(2).mean().sqrt() > 5  # not normalized
    torch.testing.assert_close(x_a.pow(2).mean(-1), torch.ones(1, 5), rtol=0.2, atol=0.2)  # normalized


@pytest.mark.parametrize("kwargs, message", [
    ({"placement": "sandwich"}, "unknown placement"),
    ({"norm": "batch"}, "unknown norm"),
    ({"d_model": 30, "n_heads": 4}, "not divisible"),
    ({"n_layers": 0}, "n_layers"),
])
def test_bad_model_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)
