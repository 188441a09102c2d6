"""``quantnorm bundle``: a run's with-past INT8 model loads in ONNX Runtime GenAI (a runtime no
one here wrote) and generates the same greedy tokens as quantnorm's own decode loop.

The run directory is built with real code and no evaluate: a tiny random Llama checkpoint with
its tokenizer (tests/test_hf.py), its with-past export, the ``dynamic`` recipe on that graph
(no calibration), and a results.json with the generation section the pipeline writes. Bad input:
one line, exit 2, nothing written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime_genai as og  # the ortgenai extra; .ci/run installs it with --no-deps
import pytest
import torch
import transformers  # the dev extra

from quantnorm.cli import main
from quantnorm.generation import DecodeSession, HFWithPast, export_with_past, greedy_decode
from quantnorm.generation.bundle import GGUF_CHECKPOINT_DIR, MANIFEST_FILE, PROMPT_MODEL_FILE, write_bundle
from quantnorm.quantize import get_recipe, quantize
from quantnorm.runs import past_onnx_file

VOCAB, EOS = 300, 2          # tests/test_hf.py's tiny Llama: LlamaConfig's eos_token_id
PROMPTS = [[28, 219, 185, 287, 5], [17, 250, 3, 99, 140, 61, 200, 7]]
NEW = 12


def results_for(checkpoint: str | dict, models: list[dict] | None, recipes: tuple[str, ...] = ("dynamic",)) -> dict:
    """A results.json of the shape the pipeline writes (only the keys the bundle reads)."""
    results = {"schema_version": 2, "model": {"source": checkpoint},
               "recipes": [{"name": name, "status": "ok"} for name in recipes]}
    if models is not None:
        results["generation"] = {"status": "measured", "models": models}
    return results


def ok_models(prefix: str = "", recipe: str = "dynamic") -> list[dict]:
    return [{"name": "fp32", "status": "ok", "path": prefix + past_onnx_file("fp32")},
            {"name": recipe, "status": "ok", "path": prefix + past_onnx_file("dynamic")}]


def write_run(run: Path, results: dict) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "results.json").write_text(json.dumps(results))
    (run / "report.md").write_text("# tiny run\n")
    return run


def make_run(root: Path, arch: str, **overrides) -> tuple[Path, Path]:
    """(run directory, checkpoint) under ``root``: a tiny random checkpoint of tests/test_hf.py's
    table (its config with ``overrides``) and tokenizer, its with-past FP32 graph and the dynamic
    recipe's INT8 one, and a results.json naming both."""
    from test_hf import ARCHS, tiny_tokenizer

    torch.manual_seed(0)
    config = ARCHS[arch][0]()
    for key, value in overrides.items():
        setattr(config, key, value)
    checkpoint, run = root / "ckpt", root / "run"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    tiny_tokenizer(False).save_pretrained(checkpoint)
    run.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(2, 5))
    fp32 = export_with_past(HFWithPast(model), run / past_onnx_file("fp32"), ids).path
    # The dynamic recipe needs no calibration; quantize's sanity check runs the graph with
    # input_ids only, so on a with-past graph its status is not read here (only its file is).
    quantize(fp32, get_recipe("dynamic"), None, run / past_onnx_file("dynamic"), vnni=False, probe_inputs=ids)
    assert (run / past_onnx_file("dynamic")).is_file()
    write_run(run, results_for("hf:../ckpt", ok_models()))
    return run, checkpoint


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(run directory, checkpoint) of a tiny Llama (grouped-query attention)."""
    return make_run(tmp_path_factory.mktemp("bundle"), "llama")


def genai_greedy(bundle: Path, prompt: list[int], new: int) -> list[int]:
    model = og.Model(str(bundle))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]


def quantnorm_greedy(graph: Path, prompt: list[int], new: int) -> list[int]:
    """quantnorm's decode loop, cut where the runtime stops: after the end-of-sequence token."""
    tokens = [int(t) for t in greedy_decode(graph, np.array([prompt]), new)[0]]
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_the_bundle_generates_quantnorms_greedy_tokens_in_ort_genai(tiny_run, tmp_path):
    run, checkpoint = tiny_run
    made = write_bundle(run, "dynamic", tmp_path / "bundle")
    out = made.path
    assert made.name == "dynamic"
    assert {"model.onnx", "genai_config.json", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "report.md", "results.json", MANIFEST_FILE} <= set(made.files)
    assert sorted(p.name for p in out.iterdir()) == made.files
    assert (out / "model.onnx").read_bytes() == (run / past_onnx_file("dynamic")).read_bytes()
    assert json.loads((out / "results.json").read_text()) == json.loads((run / "results.json").read_text())
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == 128 and genai["model"]["decoder"]["num_key_value_heads"] == 2
    assert not list(tmp_path.glob(".*")), "the temporary directory was left behind"

    # the runtime computes the graph's own logits for the prompt (the same kernels: to the bit here)
    generator = og.Generator(og.Model(str(out)), og.GeneratorParams(og.Model(str(out))))
    generator.append_tokens(np.array([PROMPTS[0]], dtype=np.int32))
    session = DecodeSession(run / past_onnx_file("dynamic"))
    np.testing.assert_allclose(np.asarray(generator.get_output("logits")), session.step(np.array([PROMPTS[0]])),
                               rtol=0, atol=1e-5)
    for prompt in PROMPTS:
        expected = quantnorm_greedy(run / past_onnx_file("dynamic"), prompt, NEW)
        assert len(expected) >= 4, "the end token came too early for the comparison to mean anything"
        assert genai_greedy(out, prompt, NEW) == expected
    # the bundle's tokenizer reads text the way the checkpoint's does
    text = "def f(x): return x + 1"
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)(text, add_special_tokens=False)["input_ids"]
    assert [int(t) for t in og.Tokenizer(og.Model(str(out))).encode(text)] == reference


def test_past_the_external_data_threshold_the_graph_keeps_its_weights_beside_it(tiny_run, tmp_path, monkeypatch):
    run, _ = tiny_run
    monkeypatch.setenv("QUANTNORM_EXTERNAL_DATA_BYTES", "10000")
    out = write_bundle(run, "dynamic", tmp_path / "bundle").path
    assert (out / "model.onnx.data").is_file()
    assert (out / "model.onnx").stat().st_size < (run / past_onnx_file("dynamic")).stat().st_size
    prompt = PROMPTS[0]
    assert genai_greedy(out, prompt, NEW) == quantnorm_greedy(run / past_onnx_file("dynamic"), prompt, NEW)


def copy_run(tiny_run, root: Path) -> Path:
    """A copy of the fixture's checkpoint and run under ``root`` (as ``ckpt`` and ``run``): a
    run directory beside it reaches them as ``../ckpt`` and ``../run/<graph>``."""
    run, checkpoint = tiny_run
    shutil.copytree(checkpoint, root / "ckpt")
    shutil.copytree(run, root / "run")
    return root / "run"


def test_a_split_deployment_is_a_two_model_pipeline_over_one_cache(tiny_run, tmp_path):
    """``W+prefill-P`` bundles as ONNX Runtime GenAI's decoder-pipeline: the prompt on P's graph, each
    new token on W's, one cache; the runtime's tokens are quantnorm's split decode loop's."""
    copy_run(tiny_run, tmp_path)
    name, graphs = "dynamic+prefill-fp32", {n: tmp_path / "run" / past_onnx_file(n) for n in ("fp32", "dynamic")}
    split = {"name": name, "status": "ok", "path": "../run/" + graphs["dynamic"].name,
             "prompt_path": "../run/" + graphs["fp32"].name, "split": {"tokens": "dynamic", "prompt": "fp32"}}
    run = write_run(tmp_path / "split", results_for("hf:../ckpt", [*ok_models("../run/"), split]))
    made = write_bundle(run, name, tmp_path / "bundle")
    out = made.path
    assert (out / PROMPT_MODEL_FILE).read_bytes() == graphs["fp32"].read_bytes()
    assert (out / "model.onnx").read_bytes() == graphs["dynamic"].read_bytes()
    model = made.genai_config["model"]
    assert model["type"] == "decoder-pipeline" and "filename" not in model["decoder"]
    (phase_p, prompt), (phase_t, tokens) = (next(iter(m.items())) for m in model["decoder"]["pipeline"])
    assert (phase_p, prompt["filename"], prompt["run_on_prompt"], prompt["run_on_token_gen"]) == \
        ("prompt", PROMPT_MODEL_FILE, True, False)
    assert (phase_t, tokens["filename"], tokens["run_on_prompt"], tokens["run_on_token_gen"]) == \
        ("tokens", "model.onnx", False, True)
    assert tokens["inputs"][-1] == "past_key_values.1.value" and tokens["outputs"][-1] == "present.1.value"
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["prompt_file"], manifest["split"]) == (PROMPT_MODEL_FILE, {"tokens": "dynamic", "prompt": "fp32"})

    # the prompt runs on the prompt graph: its logits are FP32's, not the token graph's
    generator = og.Generator(og.Model(str(out)), og.GeneratorParams(og.Model(str(out))))
    generator.append_tokens(np.array([PROMPTS[0]], dtype=np.int32))
    logits = np.asarray(generator.get_output("logits"))
    fp32, int8 = (DecodeSession(graphs[n]).step(np.array([PROMPTS[0]])) for n in ("fp32", "dynamic"))
    np.testing.assert_allclose(logits, fp32, rtol=0, atol=1e-5)
    assert np.abs(logits - int8).max() > 1e-4
    for prompt in PROMPTS:
        runner = DecodeSession(out / "model.onnx", prompt_model=out / PROMPT_MODEL_FILE)
        expected = [int(t) for t in greedy_decode(runner, np.array([prompt]), NEW)[0]]
        expected = expected[:expected.index(EOS) + 1] if EOS in expected else expected
        assert len(expected) >= 4 and genai_greedy(out, prompt, NEW) == expected


def test_auto_takes_the_search_pick_through_the_cli(tiny_run, tmp_path, capsys):
    copy_run(tiny_run, tmp_path)
    searched = write_run(tmp_path / "searched", results_for(
        "hf:../ckpt", ok_models("../run/", "auto:dynamic"), recipes=("static-minmax-matmul", "auto:dynamic")))
    assert main(["bundle", str(searched), "--recipe", "auto", "--out", str(tmp_path / "b")]) == 0, \
        capsys.readouterr().err
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["model"] == "auto:dynamic"
    assert "auto:dynamic" in capsys.readouterr().out
    assert (tmp_path / "b" / "model.onnx").read_bytes() == (tmp_path / "run" / past_onnx_file("dynamic")).read_bytes()


def test_int8_codes_made_for_vnni_are_said_and_stored_for_every_cpu_on_request(tiny_run, tmp_path, capsys):
    """The dynamic recipe quantized as on a VNNI CPU (8-bit int8 codes): the bundle says they are
    exact with VNNI only; --int8-weights unsigned stores them as uint8 (code + 128), the same
    integers on every CPU, and the runtime generates the same tokens from them."""
    import onnx

    from quantnorm.unsigned_weights import signed_weight_slots

    run = copy_run(tiny_run, tmp_path)
    graph = run / past_onnx_file("dynamic")
    quantize(run / past_onnx_file("fp32"), get_recipe("dynamic"), None, graph, vnni=True,
             probe_inputs=np.array([PROMPTS[0]]))
    signed = len(signed_weight_slots(onnx.load(str(graph))))
    assert signed > 0
    assert main(["bundle", str(run), "--recipe", "dynamic", "--out", str(tmp_path / "as-is")]) == 0
    assert f"weights: int8: {signed} products exact on CPUs with VNNI only" in capsys.readouterr().out
    assert (tmp_path / "as-is" / "model.onnx").read_bytes() == graph.read_bytes()
    assert main(["bundle", str(run), "--recipe", "dynamic", "--out", str(tmp_path / "b"), "--int8-weights",
                 "unsigned"]) == 0
    assert f"weights: uint8 (code + 128): {signed} products rewritten" in capsys.readouterr().out
    bundled = tmp_path / "b" / "model.onnx"
    assert signed_weight_slots(onnx.load(str(bundled))) == []
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["int8_weights"].startswith("uint8")
    ids = np.array([PROMPTS[1]])
    np.testing.assert_array_equal(DecodeSession(bundled).step(ids), DecodeSession(graph).step(ids))
    assert genai_greedy(tmp_path / "b", PROMPTS[1], NEW) == quantnorm_greedy(graph, PROMPTS[1], NEW)
    # a run whose codes cannot saturate (7-bit, as quantized without VNNI) says nothing
    assert main(["bundle", str(tiny_run[0]), "--recipe", "dynamic", "--out", str(tmp_path / "c")]) == 0
    assert "weights:" not in capsys.readouterr().out
    assert "int8_weights" not in json.loads((tmp_path / "c" / MANIFEST_FILE).read_text())


def test_a_gguf_run_bundles_its_dequantized_checkpoint_with_a_made_generation_config(tiny_run, tmp_path):
    from quantnorm.sources.gguf import CHECKPOINT_DIR

    assert GGUF_CHECKPOINT_DIR == CHECKPOINT_DIR
    run, checkpoint = tiny_run
    gguf_run = tmp_path / "gguf-run"
    shutil.copytree(checkpoint, gguf_run / CHECKPOINT_DIR)
    (gguf_run / CHECKPOINT_DIR / "generation_config.json").unlink()
    for name in ("fp32", "dynamic"):
        shutil.copyfile(run / past_onnx_file(name), gguf_run / past_onnx_file(name))
    write_run(gguf_run, results_for({"kind": "gguf", "file": "tiny.Q8_0.gguf", "sha256": "0" * 64}, ok_models()))
    out = write_bundle(gguf_run, "dynamic", tmp_path / "bundle").path
    made = json.loads((out / "generation_config.json").read_text())
    assert made["bos_token_id"] == 1 and made["eos_token_id"] == EOS and made["do_sample"] is False
    genai = json.loads((out / "genai_config.json").read_text())["model"]
    assert (genai["bos_token_id"], genai["eos_token_id"], genai["pad_token_id"]) == (1, EOS, EOS)


def test_force_replaces_an_earlier_bundle_and_nothing_else(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    out = tmp_path / "b"
    assert main(["bundle", str(run), "--recipe", "dynamic", "--out", str(out)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(["bundle", str(run), "--recipe", "fp32", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert main(["bundle", str(run), "--recipe", "fp32", "--out", str(out), "--force"]) == 0
    assert json.loads((out / MANIFEST_FILE).read_text())["model"] == "fp32"
    assert (out / "model.onnx").read_bytes() == (run / past_onnx_file("fp32")).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"], "the earlier bundle was left aside"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    capsys.readouterr()
    assert main(["bundle", str(run), "--recipe", "fp32", "--out", str(other), "--force"]) == 2
    assert "not a bundle" in capsys.readouterr().err and (other / "mine.txt").read_text() == "keep me"


def _bad_runs(root: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (run directory, --recipe, what the one-line error says); the runs sit in ``root``
    beside ``copy_run``'s checkpoint and run."""
    no_tokenizer = root / "ckpt-no-tokenizer"
    shutil.copytree(root / "ckpt", no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    (root / "garbage.onnx").write_bytes(b"not an onnx graph")
    graphs = ok_models("../run/")
    broken = [graphs[0], {"name": "dynamic", "status": "broken: inf scale", "path": None},
              {"name": "garbage", "status": "ok", "path": "../garbage.onnx"},
              {"name": "gone", "status": "ok", "path": "model.int8.gone.past.onnx"}]
    runs = {
        "no generation": (results_for("hf:../ckpt", None), "dynamic", "no generation results"),
        "unknown recipe": (results_for("hf:../ckpt", graphs), "static-minmax-matmul",
                           "not a recipe of this run; the run's with-past graphs: fp32, dynamic"),
        "no search": (results_for("hf:../ckpt", graphs), "auto", "no search pick"),
        "broken recipe": (results_for("hf:../ckpt", broken), "dynamic", "is broken: inf scale"),
        "not a graph": (results_for("hf:../ckpt", broken, ("garbage",)), "garbage", "does not load in ONNX"),
        "missing graph": (results_for("hf:../ckpt", broken), "gone", "is missing"),
        "no tokenizer": (results_for("hf:../ckpt-no-tokenizer", graphs), "dynamic", "has no tokenizer"),
        "zoo run": (results_for("trained", graphs), "dynamic", "zoo run"),
        "checkpoint gone": (results_for("hf:../nowhere", graphs), "dynamic", "is gone"),
    }
    return {case: (write_run(root / case.replace(" ", "-"), results), recipe, message)
            for case, (results, recipe, message) in runs.items()}


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path)
    cases = _bad_runs(tmp_path)
    (tmp_path / "empty-run").mkdir()
    cases["results.json missing"] = (tmp_path / "empty-run", "dynamic", "not found")
    cases["out is the run"] = (run, "dynamic", "is the run directory")
    not_a_bundle = tmp_path / "notes"
    not_a_bundle.mkdir()
    (not_a_bundle / "mine.txt").write_text("keep me")
    cases["out holds other files"] = (run, "dynamic", "not a bundle")
    cases["out is a file"] = (run, "dynamic", "is an existing file")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for case, (run_dir, recipe, message) in cases.items():
        out = {"out is the run": run, "out holds other files": not_a_bundle,
               "out is a file": not_a_bundle / "mine.txt"}.get(case, tmp_path / "out" / "bundle")
        assert main(["bundle", str(run_dir), "--recipe", recipe, "--out", str(out)]) == 2, case
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1, (case, err)
        assert message in err, (case, err)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before, "something was written"


def test_a_sliding_window_model_generates_up_to_its_stated_length(tmp_path):
    """Gemma 3's sliding layers: the graph is exact up to window - 1 positions (with_past.py), the
    bundle's context length says so, and the runtime generates quantnorm's tokens up to it."""
    run, _ = make_run(tmp_path, "gemma3_text", sliding_window=12, num_hidden_layers=1,
                      layer_types=["sliding_attention"])   # one layer, and it slides
    out = write_bundle(run, "dynamic", tmp_path / "bundle").path
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == genai["search"]["max_length"] == 11
    prompt = [40, 7, 120, 230, 18]
    expected = quantnorm_greedy(run / past_onnx_file("dynamic"), prompt, 11 - len(prompt))
    assert len(expected) >= 4
    assert genai_greedy(out, prompt, 11 - len(prompt)) == expected
    # the runtime itself refuses a length past the one the graph was proved at
    with pytest.raises(Exception, match="cannot be greater than model context_length"):
        genai_greedy(out, prompt, 12 - len(prompt))


def test_the_bundle_check_tool_compares_the_runtime_with_quantnorm(tiny_run, capsys):
    """tools/bundle_check.py (the real-models report's bundle line): the bundle generated from in
    ONNX Runtime GenAI, token for token against quantnorm's loop, recorded beside the run."""
    import importlib.util

    run, _ = tiny_run
    spec = importlib.util.spec_from_file_location("bundle_check", Path(__file__).parents[1] / "tools" / "bundle_check.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(run), "--recipe", "dynamic", "--new-tokens", "6", "--threads", "1"]) == 0
    result = json.loads((run / tool.OUT_FILE).read_text())
    assert result["identical"] and result["bundled"] == "dynamic" and result["runtime"] == "onnxruntime-genai 0.18.0"
    assert [r["prompt"] for r in result["prompts"]] == list(tool.PROMPTS)
    assert all(r["tokens_genai"] == r["tokens_quantnorm"] and r["prompt_tokens"] > 0 for r in result["prompts"])
    assert "every prompt identical" in capsys.readouterr().out
    assert tool.main([str(run), "--recipe", "no-such-recipe"]) == 2
    assert "no-such-recipe" in capsys.readouterr().err
    (run / tool.OUT_FILE).unlink()   # the module's run directory is shared: leave it as it was
