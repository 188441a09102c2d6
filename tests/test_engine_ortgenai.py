"""The ``ortgenai`` engine with the real ONNX Runtime GenAI: its model builder on a tiny random Llama
(tests/test_hf.py's tokenizer; hidden 64 so that its 32-wide int4 blocks fit), the models run
through its own generator and compared with the transformers model they were built from.

The builder's FP32 model must give transformers' logits (a check that token ids are fed and
positions read the way the engine says); its INT4 default must stay close (argmax agreement far
above chance). Greedy tokens are the argmax of the teacher-forced logits along them, also where
the model's argmax is the end-of-sequence token. Not installed, no Hugging Face directory, an
architecture the builder refuses: a NotMeasured with one line.
"""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import onnxruntime_genai as og  # the ortgenai extra; .ci/run installs it with --no-deps
import pytest
import torch
import transformers  # the dev extra

from quantnorm.engines import EngineRequest, NotMeasured, Speed, get_engine
from quantnorm.engines.ortgenai import INSTALL, OrtGenAIEngine, OrtGenAIModel

VOCAB = 300
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def save_checkpoint(path, config):
    from test_hf import tiny_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tiny_tokenizer(False).save_pretrained(path)
    return path


def request(tmp, hf_dir, formats=(), **kw) -> EngineRequest:
    return EngineRequest(checkpoint=hf_dir, checkpoint_kind="hf", hf_dir=hf_dir, work_dir=tmp / "engines" / "ortgenai",
                         threads=1, max_length=64, formats=formats, progress=False, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{"int4": model, "fp32": model, "torch": the transformers model, ...}: each built once."""
    root = tmp_path_factory.mktemp("ortgenai")
    checkpoint = save_checkpoint(root / "ckpt", transformers.LlamaConfig(**CONFIG))
    req = request(root, checkpoint, formats=("int4", "fp32"))
    models = list(get_engine("ortgenai").models(req))
    assert [type(m) for m in models] == [OrtGenAIModel, OrtGenAIModel], models
    out = {m.settings["precision"]: m for m in models}
    out["torch"] = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    out["work_dir"], out["checkpoint"] = req.work_dir, checkpoint
    yield out
    for m in models:
        m.close()


def windows(n=3, seq=24, seed=0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(3, VOCAB, size=(n, seq)).astype(np.int64)
    ids[:, 0] = 1
    return ids


def reference(built, ids) -> np.ndarray:
    with torch.no_grad():
        return built["torch"](torch.from_numpy(ids)).logits.float().numpy()


def test_the_builder_makes_its_cpu_default_int4_model_and_records_how(built):
    model = built["int4"]
    assert model.engine == "ortgenai" and model.version == og.__version__ == "0.18.0"
    assert model.format == "int4-b32-acc4"     # the builder's CPU defaults, read back from its graph
    s = model.settings
    assert s["builder_options"] == ["--precision", "int4", "--execution_provider", "cpu"]
    assert s["builder_version"] == "0.18.0" and s["threads"] == 1
    assert s["session_options"] == {"intra_op_num_threads": 1}
    # every linear layer and the head: 2 layers x (qkv, o, gate, up, down) + lm_head
    assert s["matmulnbits"] == [{"bits": 4, "block_size": 32, "accuracy_level": 4, "nodes": 11}]
    assert model.path == built["work_dir"] / "int4" and (model.path / "genai_config.json").is_file()
    assert model.size_bytes == sum(f.stat().st_size for f in model.path.rglob("*") if f.is_file())
    assert built["fp32"].size_bytes > 2 * model.size_bytes   # the embedding and tokenizer stay float/text
    assert built["fp32"].format == "fp32" and built["fp32"].settings["matmulnbits"] == []
    # the temporary build folders are gone; the builder's log stays beside the model
    assert sorted(p.name for p in built["work_dir"].iterdir()) == ["fp32", "fp32.builder.log", "int4",
                                                                   "int4.builder.log"]


def test_fp32_logits_are_the_transformers_models_at_every_position(built):
    ids = windows()
    got = built["fp32"].logits(ids)
    assert got.shape == (3, 24, VOCAB) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(built, ids), atol=1e-4)


def test_int4_logits_stay_close_to_the_transformers_model(built):
    ids = windows()
    got, ref = built["int4"].logits(ids), reference(built, ids)
    assert got.shape == ref.shape
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert agreement >= 0.6, agreement                  # chance is 1/300
    assert 0 < np.abs(got - ref).max() < 0.5 * np.abs(ref).max()   # quantized, not broken


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_logits(built, precision):
    model, prompts, new = built[precision], windows(2, 10, seed=1), 12
    tokens = model.greedy(prompts, new)
    assert tokens.shape == (2, new) and tokens.dtype == np.int64
    along = model.logits(np.concatenate([prompts, tokens[:, :-1]], axis=1))
    np.testing.assert_array_equal(along[:, prompts.shape[1] - 1:].argmax(-1), tokens)


def test_greedy_does_not_stop_or_swerve_at_the_end_of_sequence_token(built, tmp_path):
    """The same FP32 model with the third greedy token declared end of sequence: the tokens stay."""
    prompts, new = windows(1, 10, seed=1), 8
    tokens = built["fp32"].greedy(prompts, new)
    folder = tmp_path / "eos"
    shutil.copytree(built["fp32"].path, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = int(tokens[0, 2])
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = OrtGenAIModel(folder, built["fp32"].settings, threads=1)
    np.testing.assert_array_equal(model.greedy(prompts, new), tokens)
    model.close()


def test_without_threads_the_runtime_keeps_its_default_and_says_so(built):
    model = OrtGenAIModel(built["fp32"].path, built["fp32"].settings, threads=None)
    assert model.settings["threads"] is None and model.settings["session_options"] == {}
    ids = windows(1, 8)
    np.testing.assert_array_equal(model.logits(ids), built["fp32"].logits(ids))
    model.close()


def test_speed_is_measured_at_batch_one(built):
    speed = built["int4"].speed(windows(1, 16)[0], 8, rounds=2)
    assert isinstance(speed, Speed)
    assert (speed.prompt_tokens, speed.new_tokens, speed.rounds) == (16, 8, 2)
    assert speed.prompt_tok_s > 0 and speed.gen_tok_s > 0 and speed.token_ms_p50 > 0


def test_not_installed_is_not_measured_with_the_install_command(built, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)   # import raises ImportError
    engine = OrtGenAIEngine()
    assert engine.available() == f"not installed: {INSTALL}"
    rows = list(engine.models(request(tmp_path, built["checkpoint"])))
    assert rows == [NotMeasured("ortgenai", "int4", f"not installed: {INSTALL}")]
    assert not (tmp_path / "engines").exists()


def test_no_hugging_face_directory_and_unknown_formats_are_not_measured(built, tmp_path):
    req = EngineRequest(checkpoint=tmp_path / "x.onnx", checkpoint_kind="onnx", hf_dir=None,
                        work_dir=tmp_path / "w", threads=1, max_length=64, progress=False)
    (row,) = OrtGenAIEngine().models(req)
    assert isinstance(row, NotMeasured) and "Hugging Face directory" in row.reason
    (row,) = OrtGenAIEngine().models(request(tmp_path, built["checkpoint"], formats=("q4_k_m",)))
    assert isinstance(row, NotMeasured) and "choose from int4, int8, fp32" in row.reason


def test_an_architecture_the_builder_refuses_is_not_measured_with_its_reason(tmp_path):
    from test_hf import ARCHS

    bert = tmp_path / "bert"
    torch.manual_seed(0)
    transformers.BertForMaskedLM(ARCHS["bert"][0]()).save_pretrained(bert)
    from test_hf import tiny_tokenizer

    tiny_tokenizer(True).save_pretrained(bert)
    req = request(tmp_path, bert)
    (row,) = OrtGenAIEngine().models(req)
    assert isinstance(row, NotMeasured) and row.format == "int4"
    assert row.reason.startswith("ONNX Runtime GenAI's model builder refused bert: ")
    assert "\n" not in row.reason and "not currently supported" in row.reason, row.reason
    assert not (req.work_dir / "int4").exists() and not list(req.work_dir.glob(".*.tmp"))
