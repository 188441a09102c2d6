"""The with-past (KV cache) export, decoding it on ONNX Runtime, and the cache proof.

Tiny models only, nothing downloaded: a zoo model of each placement, and tiny random Llama and
Gemma 3 checkpoints built from their configs (tests/test_hf.py's table). Each graph is exported
once per module and only read by the tests.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_cache import outside_the_export

from quantnorm.errors import ConfigError, ExportError
from quantnorm.export import export_onnx
from quantnorm.generation import (
    DecodeSession,
    HFWithPast,
    ZooWithPast,
    check_cache,
    export_with_past,
    greedy_decode,
    past_names,
    present_names,
)
from quantnorm.generation.agreement import fp32_continuation, generation_agreement
from quantnorm.models import PLACEMENTS, CausalLM, ModelConfig

transformers = pytest.importorskip("transformers")  # the hf extra; .ci/run installs it

CONTEXT = 24


def zoo_model(placement: str) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement=placement, n_layers=2, d_model=32, n_heads=4, context=CONTEXT)).eval()
    for m in model.modules():  # an untrained model's logits are nearly flat: give the argmax margins
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.3)
    return model


def hf_model(name: str, **overrides):
    from test_hf import ARCHS

    torch.manual_seed(0)
    config = ARCHS[name][0]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def windows(n: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(n, seq)).astype(np.int64)


def torch_greedy(logits_of, prompts: np.ndarray, new: int) -> np.ndarray:
    """Greedy tokens from whole-window forwards in PyTorch (no cache at all): the reference."""
    ids = torch.from_numpy(prompts)
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, logits_of(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1]:].numpy()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (with-past path, export result, torch model); zoo placements and "llama"."""
    root = tmp_path_factory.mktemp("with-past")
    done = {}

    def get(name: str):
        if name not in done:
            if name in PLACEMENTS:
                model = zoo_model(name)
                wrapper, vocab = ZooWithPast(model), model.cfg.vocab_size
            else:
                model = hf_model(name)
                wrapper, vocab = HFWithPast(model), model.config.vocab_size
            result = export_with_past(wrapper, root / f"{name}.onnx", windows(2, 6, vocab))
            done[name] = (result.path, result, model)
        return done[name]

    return get


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_zoo_cache_proof_and_greedy_tokens(exported, placement):
    path, result, model = exported(placement)
    assert set(result.max_abs_diff) == {"prompt", "prompt, last position", "decode 1", "decode 2"}
    assert max(result.max_abs_diff.values()) <= 1e-4
    graph = onnx.load(str(path))
    assert [i.name for i in graph.graph.input] == ["input_ids", "attention_mask", "position_ids", *past_names(2),
                                                    "logits_to_keep"]
    assert result.keeps_logits and result.to_dict()["optional_inputs"] == ["logits_to_keep"]
    assert [o.name for o in graph.graph.output] == ["logits", *present_names(2)]

    check = check_cache(path, windows(3, 20, 257, seed=1), prefill=7)
    assert check.ok and check.relative_diff <= 1e-4, check.to_dict()
    assert 0 < check.nll_whole < 20

    prompts = windows(3, 5, 257, seed=2)
    tokens = greedy_decode(path, prompts, 10)
    assert tokens.shape == (3, 10)
    np.testing.assert_array_equal(tokens, torch_greedy(model, prompts, 10))


def test_llama_through_transformers_cache(exported):
    path, result, model = exported("llama")
    assert result.kv_heads == 2 and result.head_dim == 8 and result.max_length == 128   # grouped-query attention
    check = check_cache(path, windows(3, 20, 300, seed=1), prefill=5)
    assert check.ok, check.to_dict()

    prompts = windows(2, 6, 300, seed=2)
    tokens = greedy_decode(path, prompts, 12)
    np.testing.assert_array_equal(tokens, torch_greedy(lambda ids: model(ids, use_cache=False).logits, prompts, 12))
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                               eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        generated = model.generate(torch.from_numpy(prompts), generation_config=generation)
    np.testing.assert_array_equal(tokens, generated[:, 6:].numpy())


@pytest.mark.parametrize("name", ["pre", "llama", "gemma2"])
def test_a_prompt_step_can_run_the_head_on_its_last_position_only(exported, name):
    """``logits_to_keep``: the head runs on the kept rows (a Slice in front of it), their logits
    are the whole step's, the cache is the same, and a graph fed nothing keeps every position."""
    path, result, _ = exported(name)
    graph = onnx.load(str(path), load_external_data=False).graph
    sliced = next(n for n in graph.node if n.name.endswith("/keep_logits/Slice"))
    head = next(n for n in graph.node if sliced.output[0] in n.input)
    assert head.op_type == "MatMul" and result.keeps_logits   # gemma2: its logit softcap comes after the head
    vocab = 257 if name == "pre" else 300   # the zoo's byte vocabulary; test_hf's tiny configs
    prompts = windows(2, 7, vocab, seed=3)
    runner = DecodeSession(path)
    runner.reset(2)
    every = runner.step(prompts)
    every_cache = runner.cache()
    runner.reset(2)
    last = runner.step(prompts, last_only=True)
    assert every.shape[1] == 7 and last.shape == (2, 1, every.shape[2])
    np.testing.assert_allclose(last, every[:, -1:], rtol=0, atol=1e-5)
    for a, b in zip(runner.cache(), every_cache):
        np.testing.assert_array_equal(a, b)
    # fed 1 explicitly, the session computes one row: the graph's own output has one position
    raw = runner.session.run(["logits"], {"input_ids": prompts, "attention_mask": np.ones((2, 7), np.int64),
                                          "position_ids": np.tile(np.arange(7), (2, 1)),
                                          "logits_to_keep": np.array([3]),
                                          **dict(zip(past_names(result.n_layers), runner.layout.empty(2)))})[0]
    np.testing.assert_allclose(raw, every[:, -3:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_grouped_query_attention_reads_the_cache_without_repeating_it(exported, name):
    """4 query heads on 2 key/value heads: the exported repeat_kv copies (Unsqueeze, Expand,
    Reshape) are gone, each layer's two attention matmuls read the cache as it is, and the
    export's parity gate (step by step against PyTorch) held; gemma2 has sliding layers too."""
    path, result, _ = exported(name)
    graph = onnx.load(str(path)).graph
    assert not [n.name for n in graph.node if n.op_type == "Expand" and "self_attn" in n.name]
    # llama's grouped matmuls are then fused into GroupQueryAttention (the next test); gemma2's stay
    assert len([n for n in graph.node if n.name.endswith("/Grouped")]) == 2 * (result.n_layers - result.fused_attention)
    assert max(result.max_abs_diff.values()) <= 1e-4


@pytest.mark.parametrize("name, fused", [("llama", 2), ("gemma2", 0)])
def test_attention_is_one_group_query_attention_node_where_the_pass_finds_it(exported, name, fused):
    """Each llama layer's attention core (the grouped matmuls, scale, mask, softmax and the cache's
    Concat) is one com.microsoft.GroupQueryAttention node and the parity gate held; gemma2's
    attention logit softcap (a Tanh between the scores and the mask) is not the matched chain,
    so its layers stay as exported."""
    path, result, _ = exported(name)
    graph = onnx.load(str(path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == fused == result.fused_attention
    assert len([n for n in graph.node if n.op_type == "Softmax"]) == result.n_layers - fused
    assert result.to_dict()["attention"].startswith("com.microsoft.GroupQueryAttention" if fused else "as exported")
    if fused:
        assert {o for n in nodes for o in n.output[1:]} == set(present_names(result.n_layers))
    assert max(result.max_abs_diff.values()) <= 1e-4


def test_fused_attention_computes_the_exported_attention_and_unmatched_chains_stay(exported, tmp_path):
    """The same llama exported without the fusion (standard operators only) and with it: the same
    logits and cache through a batch-3 prompt and four single-token steps. A layer whose chain
    differs (its softmax over another axis, a mask that is not a boolean one made additive) is
    left as exported."""
    from quantnorm.generation.graph_passes import fuse_group_query_attention

    fused_path, fused_result, model = exported("llama")
    plain = export_with_past(HFWithPast(model), tmp_path / "plain.onnx", windows(2, 6, 300), fuse_attention=False)
    graph = onnx.load(str(plain.path))
    assert plain.fused_attention == 0 and not [n for n in graph.graph.node if n.domain == "com.microsoft"]
    prompts, tokens = windows(3, 9, 300, seed=4), windows(4, 3, 300, seed=5)
    runs = []
    for path in (plain.path, fused_path):
        runner = DecodeSession(path)
        runner.reset(3)
        logits = [runner.step(prompts)] + [runner.step(t[:, None]) for t in tokens]
        runs.append((logits, runner.cache()))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)

    softmax = [n for n in graph.graph.node if n.op_type == "Softmax"]
    del softmax[0].attribute[:]
    softmax[0].attribute.append(onnx.helper.make_attribute("axis", 2))
    mask_add = next(n for n in graph.graph.node if n.op_type == "Add" and softmax[1].input[0] in n.output)
    graph.graph.node.append(onnx.helper.make_node("Identity", [mask_add.input[1]], ["mask_with_a_bias"]))
    mask_add.input[1] = "mask_with_a_bias"
    assert fuse_group_query_attention(graph, 4, 2, 8, plain.max_length) == 0
    assert len([n for n in graph.graph.node if n.op_type == "Softmax"]) == 2


@pytest.mark.parametrize("name, overrides", [("llama", {"head_dim": 16}),
                                             ("gemma3_text", {"head_dim": 16, "sliding_window": 12})])
def test_the_operator_rotates_where_the_head_size_allows(tmp_path, name, overrides):
    """Head size 16 (ONNX Runtime's CPU kernel rotates multiples of 16): the rotary embedding
    moves into the operator too (its cos and sin caches computed by the graph's own nodes for
    every position), gemma3's q/k norms and query scale included; the fused graph decodes what
    the graph with standard operators decodes."""
    model = hf_model(name, **overrides)
    prompts = windows(2, 6, 300)
    fused = export_with_past(HFWithPast(model), tmp_path / "fused.onnx", prompts)
    plain = export_with_past(HFWithPast(model), tmp_path / "plain.onnx", prompts, fuse_attention=False)
    graph = onnx.load(str(fused.path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == fused.fused_attention == 2
    assert all(onnx.helper.get_attribute_value(a) == 1 for n in nodes for a in n.attribute if a.name == "do_rotary")
    assert all(len(n.input) == 9 for n in nodes)   # ... seqlens_k, total_sequence_length, cos_cache, sin_cache
    assert not [n for n in graph.node if n.op_type == "Neg" and "self_attn" in n.name]   # rotate_half is gone
    caches = {t.name: list(t.dims) for t in graph.initializer if t.name.startswith("gqa/cos_cache")}
    assert caches and all(dims == [fused.max_length, 8] for dims in caches.values())
    runs = []
    for path in (plain.path, fused.path):
        runner = DecodeSession(path)
        runner.reset(3)
        logits = [runner.step(windows(3, 5, 300, seed=6))] + [runner.step(t[:, None]) for t in windows(4, 3, 300, seed=7)]
        runs.append(logits + runner.cache())
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    # split in two graphs (the prompt on the standard operators, the tokens on the fused operator,
    # one cache), three prompts at once: the same model, so FP32's own continuation, token for token
    reference = fp32_continuation(plain.path, windows(3, 5, 300, seed=8), 4)
    agreement = generation_agreement(fused.path, reference, prompt_path=plain.path)
    assert agreement["identical_before_divergence"] == 1.0 and agreement["kl_mean"] < 1e-6


def test_a_wrong_head_grouping_fails_the_export(monkeypatch, tmp_path):
    """The parity gate catches a pass that groups the heads wrongly (here: as one key head)."""
    from quantnorm.generation import with_past

    real = with_past.attend_without_repeating_kv   # a pass on the exported graph
    outside_the_export(monkeypatch)
    monkeypatch.setattr(with_past, "attend_without_repeating_kv",
                        lambda model, heads, kv_heads, head_dim: real(model, heads, 1, head_dim))
    with pytest.raises(ExportError):   # unfused: the fusion would replace the wrongly grouped matmuls
        export_with_past(HFWithPast(hf_model("llama")), tmp_path / "wrong.onnx", windows(2, 6, 300),
                         fuse_attention=False)
    assert not list(tmp_path.iterdir())


def test_a_wrong_attention_fusion_fails_the_export(monkeypatch, tmp_path):
    """The parity gate catches a fused operator that attends wrongly (here: at twice the scale)."""
    from quantnorm.generation import with_past

    real = with_past.fuse_group_query_attention

    def doubled(model, *args):
        fused = real(model, *args)
        for node in model.graph.node:
            for attribute in node.attribute:
                if node.op_type == "GroupQueryAttention" and attribute.name == "scale":
                    attribute.f *= 2
        return fused

    outside_the_export(monkeypatch)   # a pass on the exported graph
    monkeypatch.setattr(with_past, "fuse_group_query_attention", doubled)
    with pytest.raises(ExportError, match="does not match PyTorch"):
        export_with_past(HFWithPast(hf_model("llama")), tmp_path / "wrong.onnx", windows(2, 6, 300))
    assert not list(tmp_path.iterdir())


def test_the_check_scores_whole_windows_with_the_whole_window_graph_too(exported, tmp_path):
    path, _, model = exported("pre")
    ids = windows(3, 20, 257, seed=1)
    whole = export_onnx(model, tmp_path / "whole.onnx", ids).path
    check = check_cache(path, ids, prefill=4, whole=whole)
    assert check.ok, check.to_dict()


def test_a_cache_that_loses_its_past_fails_the_check(exported, monkeypatch):
    """The check can fail: a step that forgets the cache (as a graph ignoring its past would)
    scores differently from the whole window."""
    path, _, _ = exported("pre")
    step = DecodeSession.step

    def forgetful(self, input_ids, **options):
        logits = step(self, input_ids, **options)
        self.past = [type(v).ortvalue_from_numpy(np.zeros_like(v.numpy())) for v in self.past]
        return logits

    monkeypatch.setattr(DecodeSession, "step", forgetful)
    check = check_cache(path, windows(2, 12, 257, seed=1), prefill=3)
    assert not check.ok and check.relative_diff > 1e-3


def test_parity_failure_raises_and_leaves_no_file(tmp_path):
    model = zoo_model("post")
    with pytest.raises(ExportError, match="does not match PyTorch with its cache"):
        export_with_past(ZooWithPast(model), tmp_path / "past.onnx", windows(2, 6, 257), tolerance=1e-12)
    assert list(tmp_path.iterdir()) == [], "a failed export left files behind"


def test_sliding_window_layers_state_their_maximum_length(tmp_path):
    """Gemma 3's sliding layers keep window - 1 keys: the graph is exact up to that length, says
    so in its metadata, and a decode past it is refused in one line."""
    wrapper = HFWithPast(hf_model("gemma3_text", sliding_window=12))
    assert wrapper.max_length == 11
    result = export_with_past(wrapper, tmp_path / "gemma3.onnx", windows(2, 5, 300))
    path = result.path
    # within those 11 positions a sliding layer's window keeps its whole cache: its attention is
    # fused like a full layer's (its q/k norms stay in front of the operator)
    assert result.fused_attention == result.n_layers == 2
    assert check_cache(path, windows(2, 11, 300, seed=1), prefill=4).ok
    assert DecodeSession(path).layout.max_length == 11
    with pytest.raises(ConfigError, match="exceed the model's 11 positions"):
        greedy_decode(path, windows(1, 8, 300), 5)


def test_bad_graphs_and_prompts_are_one_line_errors(exported, tmp_path):
    path, _, _ = exported("pre")
    with pytest.raises(ConfigError, match=f"exceed the model's {CONTEXT} positions"):
        greedy_decode(path, windows(1, 20, 257), 6)
    with pytest.raises(ConfigError, match="parity prompt and 2 decode steps need"):
        export_with_past(ZooWithPast(zoo_model("pre")), tmp_path / "x.onnx", windows(1, CONTEXT - 1, 257))
    assert not (tmp_path / "x.onnx").exists()

    graph = onnx.load(str(path))
    dropped = [o for o in graph.graph.output if o.name == "present.1.value"][0]
    graph.graph.output.remove(dropped)
    onnx.save(graph, str(tmp_path / "mismatched.onnx"))
    with pytest.raises(ConfigError, match="present outputs do not match the past inputs"):
        greedy_decode(tmp_path / "mismatched.onnx", windows(1, 4, 257), 2)

    whole = export_onnx(zoo_model("pre"), tmp_path / "whole.onnx", windows(2, 8, 257)).path
    with pytest.raises(ConfigError, match="not a with-past causal LM"):
        greedy_decode(whole, windows(1, 4, 257), 2)


def test_a_fused_graph_keeps_its_cache_in_one_buffer_written_in_place(exported, tmp_path):
    """The fused llama's cache is read and written only by GroupQueryAttention, so a decode
    session binds one buffer per layer as its past and its present; the buffer grows when a step
    needs room. Logits and cache equal those of the same graph run with a fresh present per step,
    and the buffer itself holds the keys (ORT wrote into it). A graph of standard operators
    cannot share (its Concat needs the past as long as the tokens so far)."""
    from quantnorm.generation.decode import writes_cache_in_place

    fused_path, _, model = exported("llama")
    plain = export_with_past(HFWithPast(model), tmp_path / "plain.onnx", windows(2, 6, 300), fuse_attention=False)
    assert writes_cache_in_place(fused_path, 2) and not writes_cache_in_place(plain.path, 2)
    assert not DecodeSession(plain.path).shared
    with pytest.raises(ConfigError, match="GroupQueryAttention"):
        DecodeSession(plain.path, shared_cache=True)
    prompts, tokens = windows(3, 5, 300, seed=8), windows(6, 3, 300, seed=9)
    runs = []
    for shared in (False, True):
        runner = DecodeSession(fused_path, shared_cache=shared)
        assert runner.shared is shared
        runner.reset(3, tokens=2)   # smaller than the prompt: the buffer grows at the prompt and twice after
        logits = [runner.step(prompts)] + [runner.step(t[:, None]) for t in tokens]
        runs.append(logits + runner.cache())
        if shared:
            assert runner._buffers[0].shape[2] == 20 and np.abs(runner._buffers[0][:, :, :11]).min() > 0
            assert not runner._buffers[0][:, :, 11:].any()
    assert [a.shape for a in runs[0]] == [b.shape for b in runs[1]]
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert DecodeSession(fused_path).shared   # the default where the graph allows


def test_query_key_and_value_are_packed_into_one_product(tmp_path):
    """A weight-only and a per-token recipe's fused llama: each layer's q, k and v MatMulNBits (or
    MatMulIntegerToFloat) become one, read by GroupQueryAttention as its packed input (key and
    value inputs empty), the reshapes between them gone; the packed graph's logits and cache
    equal the unpacked graph's (the same codes and scales per column), and its cache is still one
    shared buffer. The FP32 graph has nothing to pack and is left as it is."""
    from quantnorm.generation.qkv_packing import pack_qkv_file
    from quantnorm.quantize import get_recipe, quantize

    # head size 16: the rotary embedding moves into the operator, so q, k and v reach it unrotated
    fused_path = export_with_past(HFWithPast(hf_model("llama", head_dim=16)), tmp_path / "fused.onnx",
                                  windows(2, 6, 300)).path
    calib = windows(4, 8, 300, seed=3)
    graphs = {}
    # vnni=False: the per-token recipe's unsigned weights, a zero point per column packed with them
    for label, name, vnni in (("wo", "wo-int8-b32-acc4", True), ("pt", "pertoken-fused", True),
                              ("pt-unsigned", "pertoken-fused", False)):
        q = quantize(fused_path, get_recipe(name), calib, tmp_path / f"{label}.onnx", vnni=vnni,
                     probe_inputs=calib[:1], diagnostics=False)
        assert q.status == "ok", q.problems
        graphs[label] = q.path
    assert pack_qkv_file(fused_path) == 0
    count = lambda g, op: sum(n.op_type == op for n in g.node)   # noqa: E731
    for name, product in (("wo", "MatMulNBits"), ("pt", "MatMulIntegerToFloat"), ("pt-unsigned", "MatMulIntegerToFloat")):
        unpacked = tmp_path / f"unpacked-{name}.onnx"
        unpacked.write_bytes(graphs[name].read_bytes())
        before = onnx.load(str(unpacked)).graph
        assert pack_qkv_file(graphs[name]) == 2
        after = onnx.load(str(graphs[name])).graph
        assert count(after, product) == count(before, product) - 2 * 2
        assert count(after, "Reshape") == count(before, "Reshape") - 2 * 6
        for gqa in (n for n in after.node if n.op_type == "GroupQueryAttention"):
            assert gqa.input[0].endswith("/qkv") and list(gqa.input[1:3]) == ["", ""]
        packed = [n for n in after.node if n.name.endswith("/qkv/" + product)]
        assert len(packed) == 2 and all(len(n.input) == (6 if name == "pt-unsigned" else 5 if name == "pt" else 3)
                                        for n in packed)
        assert not any(n.op_type == "Reshape" and n.input[0].startswith("linear") for n in after.node)
        prompts, tokens = windows(2, 5, 300, seed=4), windows(4, 2, 300, seed=5)
        runs = []
        for path in (unpacked, graphs[name]):
            runner = DecodeSession(path)
            assert runner.shared
            runner.reset(2, tokens=9)
            runs.append([runner.step(prompts)] + [runner.step(t[:, None]) for t in tokens] + runner.cache())
        for a, b in zip(*runs):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert np.abs(runs[0][0]).max() > 0.1   # logits that say something


def test_products_that_read_one_input_become_one_and_a_split(tmp_path):
    """``pack_products_file`` on a weight-only graph of Gemma 3, whose per-head q/k norms keep q, k
    and v from GroupQueryAttention's packed input: q/k/v become one MatMulNBits and a Split, as
    does every gate/up pair (llama's q/k/v go into the attention's input: the test above), and
    each residual add read by an RMSNorm becomes a SkipSimplifiedLayerNormalization; the
    rewritten graph's logits and cache equal the original's at accuracy_level 4 (the input's
    int8 blocks are the same whoever reads them) up to the fused norm's float rounding."""
    from quantnorm.generation.qkv_packing import pack_products_file
    from quantnorm.quantize import get_recipe, quantize

    qkv_layers, shared_groups = 0, 4   # 2 layers x (q/k/v, gate/up)
    model = hf_model("gemma3_text")
    fused_path = export_with_past(HFWithPast(model), tmp_path / "fused.onnx", windows(2, 6, 300)).path
    calib = windows(4, 8, 300, seed=3)
    q = quantize(fused_path, get_recipe("wo-int8-b32-acc4"), calib, tmp_path / "wo.onnx", vnni=True,
                 probe_inputs=calib[:1], diagnostics=False)
    assert q.status == "ok", q.problems
    unpacked = tmp_path / "unpacked.onnx"
    unpacked.write_bytes(q.path.read_bytes())
    before = onnx.load(str(unpacked)).graph
    residual_norms = 2 * 2   # each block's two residual adds, each read by the next norm (the last by the final norm)
    assert pack_products_file(q.path, residual_norms=True) == {"qkv_layers": qkv_layers, "shared_groups": shared_groups,
                                                               "residual_norms": residual_norms}
    after = onnx.load(str(q.path)).graph
    count = lambda g, op: sum(n.op_type == op for n in g.node)   # noqa: E731
    # per layer: q, k, v -> 1 and gate, up -> 1, each with a Split
    assert count(after, "MatMulNBits") == count(before, "MatMulNBits") - 2 * 3
    assert count(after, "Split") == count(before, "Split") + shared_groups
    assert count(after, "SkipSimplifiedLayerNormalization") == residual_norms
    prompts, tokens = windows(2, 5, 300, seed=4), windows(4, 2, 300, seed=5)
    runs = []
    for path in (unpacked, q.path):
        runner = DecodeSession(path)
        runner.reset(2, tokens=9)
        runs.append([runner.step(prompts)] + [runner.step(t[:, None]) for t in tokens] + runner.cache())
    for a, b in zip(*runs):   # the fused norms sum and normalize in one pass: not bit for bit
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert np.abs(runs[0][0]).max() > 0.1
    assert pack_products_file(q.path, residual_norms=True) == {"qkv_layers": 0, "shared_groups": 0,
                                                               "residual_norms": 0}   # nothing left to pack


def test_a_step_reads_every_weight_but_the_token_table_and_rotary_caches(exported, tmp_path):
    """``weights_read_per_step``: the bytes of every stored initializer except those a one-token
    step reads a row of (the embedding under Gather; GroupQueryAttention's cos and sin caches where
    the rotary embedding moved into the operator), counted here from the parsed graph."""
    from quantnorm.generation.speed import step_profile, weights_read_per_step
    from quantnorm.measure.sessions import SessionSpec

    fused = export_with_past(HFWithPast(hf_model("llama", head_dim=16)), tmp_path / "rotary.onnx",
                             windows(2, 6, 300)).path
    for path in (exported("llama")[0], exported("pre")[0], fused):
        graph = onnx.load(str(path)).graph
        stored = {t.name: onnx.numpy_helper.to_array(t).nbytes for t in graph.initializer
                  if t.HasField("raw_data") or t.data_location == onnx.TensorProto.EXTERNAL}
        tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in stored}
        caches = {n.input[i] for n in graph.node if n.op_type == "GroupQueryAttention" and len(n.input) > 8
                  for i in (7, 8)}
        assert tables and (caches or path != fused)
        read_whole = {name for n in graph.node for name in n.input} - tables - caches
        expected = sum(size for name, size in stored.items() if name in read_whole)
        assert weights_read_per_step(path) == expected
    profile = step_profile(fused, windows(1, 5, 300), steps=3, spec=SessionSpec(threads=1))
    assert profile["steps"] == 3 and "GroupQueryAttention" in profile["op_ms"]
    with pytest.raises(ConfigError, match="steps >= 1"):
        step_profile(fused, windows(1, 5, 300), steps=0, spec=SessionSpec(threads=1))
