"""The generation stage of evaluate, end to end on every source kind: each recipe quantized again
on the with-past graph, the cache proof per model, decode speed rows and generation agreement,
in results.json and the report; and the feed that lets every stage run a with-past graph."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from export_cache import outside_the_export
from onnx import numpy_helper

from quantnorm.cli import main
from quantnorm.errors import ConfigError
from quantnorm.export import write_onnx_dir
from quantnorm.feeds import is_with_past, window_feeder
from quantnorm.generation import ZooWithPast, export_with_past
from quantnorm.measure.accuracy import compare
from quantnorm.results import generation_models, validate

sys.path.insert(0, str(Path(__file__).parent))
from test_generation import windows, zoo_model  # noqa: E402

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "8", "--steps", "40"]
FAST = ["--batches", "1", "--iters", "2", "--calib-samples", "8", "--quiet", "--threads", "1"]
GEN = ["--gen-tokens", "12,12", "--gen-batches", "1,2", "--agreement", "4,8"]
EXACT = 1e-4   # the cache proof's relative tolerance


def _results(run: Path) -> dict:
    results = json.loads((run / "results.json").read_text())
    validate(results)
    return results


def _check_models(results: dict, exact: tuple[str, ...], *, new_tokens: int = 12) -> dict:
    """Every ok model: its with-past file, measured CPU rows, and agreement within its ranges;
    the models named in ``exact`` pass the cache proof."""
    section = results["generation"]
    assert section["status"] == "measured"
    models = {m.name: m for m in generation_models(results)}
    assert list(models)[0] == "fp32" and models["fp32"].agreement is None
    for name in ("fp32", *exact):
        assert models[name].ok and models[name].cache_check["relative_diff"] <= EXACT, (name, models[name].entry)
    for m in models.values():
        if not m.ok:
            continue
        cpu = [r for r in m.decode if r["provider"] == "CPUExecutionProvider"]
        assert [r["batch"] for r in cpu] == [1, 2] and all(r["status"] == "measured" for r in cpu)
        for r in cpu:
            assert r["prompt_tokens_per_s"] > 0 and r["gen_tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
            assert r["new_tokens"] == new_tokens and len(r["per_position_ms"]) == new_tokens - 1
            assert 0 < r["token_ms_p50"] <= r["token_ms_p90"]
        _check_step_profile(m.name, cpu, new_tokens)
        if m.name != "fp32":
            a = m.agreement
            assert 0.0 <= a["identical_before_divergence"] <= 1.0 and 0 <= a["identical_prompts"] <= a["prompts"]
            assert 0.0 <= a["first_divergence_mean"] <= a["new_tokens"] and a["kl_mean"] >= 0.0
    return models


def _check_step_profile(name: str, rows: list[dict], new_tokens: int) -> None:
    """Batch 1 says where a one-token step's time goes; the batch-2 row has no profile."""
    profile = rows[0]["step_profile"]
    assert "step_profile" not in rows[1]
    assert profile["steps"] == min(32, new_tokens - 1) and profile["batch"] == 1 and profile["nodes"] > 10
    assert abs(sum(profile["op_ms"].values()) - profile["kernel_ms"]) < 1e-3 * len(profile["op_ms"])
    assert 0 < profile["kernel_ms"] <= profile["run_ms"] and profile["weight_bytes"] > 0
    assert list(profile["op_ms"].values()) == sorted(profile["op_ms"].values(), reverse=True)
    if name.startswith("wo-"):   # a split's token graph is its weight-only one: the profile is of that graph
        assert "MatMulNBits" in profile["op_ms"] and "MatMulIntegerToFloat" not in profile["op_ms"]


PREPROCESSED: list[str] = []   # the FP32 models zoo_run pre-processed for quantization, in order


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory) -> Path:
    from quantnorm.quantize import ort_backend

    out = tmp_path_factory.mktemp("gen-zoo") / "run"
    recipes = "static-minmax-matmul,dynamic,pertoken-fused-gptq,online-rotated-pertoken-fused,smoothquant,wo-int8-b32-acc4"
    preprocess = ort_backend._preprocess
    with pytest.MonkeyPatch.context() as patch:
        outside_the_export(patch)   # a spy on the quantizer's pre-processing: the exports stay cacheable
        patch.setattr(ort_backend, "_preprocess", lambda src, dst: PREPROCESSED.append(src.name) or preprocess(src, dst))
        assert main(["evaluate", "--placement", "pre", "--norm", "rms", *TINY, *FAST, *GEN, "--out", str(out),
                     "--recipes", recipes, "--prefill-recipe", "pertoken-fused-gptq", "--providers", "cpu,cuda"]) == 0
    return out


def test_zoo_every_recipe_generates_through_its_cache(zoo_run):
    results = _results(zoo_run)
    models = _check_models(results, ("static-minmax-matmul", "pertoken-fused-gptq", "online-rotated-pertoken-fused",
                                     "smoothquant"))
    assert set(models) == {"fp32", "static-minmax-matmul", "dynamic", "pertoken-fused-gptq",
                           "online-rotated-pertoken-fused", "smoothquant", "wo-int8-b32-acc4", SPLIT, ONE_ROW,
                           "online-rotated-pertoken-fused+one-row"}
    # each recipe quantized its own transformed with-past model
    assert models["online-rotated-pertoken-fused"].entry["quantized_from"] == "model.fp32.rotated-online.past.onnx"
    assert models["smoothquant"].entry["quantized_from"] == "model.fp32.smoothquant.past.onnx"
    assert models["dynamic"].entry["quantized_from"] == "model.fp32.past.onnx"
    for m in models.values():
        assert (zoo_run / m.path).is_file()
    # each FP32 model, whole-window or with-past, pre-processed once for all the recipes it serves
    assert sorted(PREPROCESSED) == sorted(set(PREPROCESSED)) and "model.fp32.past.onnx" in PREPROCESSED
    # an absent GPU is "not measured: why", never a number
    cuda = [r for r in models["fp32"].decode if r["provider"] == "CUDAExecutionProvider"]
    assert cuda and all(r["status"].startswith("not measured: ") and "gen_tokens_per_s" not in r for r in cuda)
    settings = results["generation"]["settings"]
    assert (settings["prompt_tokens"], settings["new_tokens"], settings["agreement_new_tokens"]) == (12, 12, 8)
    assert settings["agreement_prompt_tokens"] + 8 <= 32   # cut to the 32-position context
    report = (zoo_run / "report.md").read_text()
    assert "## Generation (KV cache)" in report and "### Generation agreement" in report
    assert "| `pertoken-fused-gptq` | 1 |" in report and (zoo_run / "plots" / "token_latency.png").is_file()
    steps = report.split("### Where a one-token step's time goes, CPU (batch 1)")[1].split("###")[0]
    assert all(f"| `{name}` |" in steps for name in models) and "streamed GB/s" in steps


SPLIT = "wo-int8-b32-acc4+prefill-pertoken-fused-gptq"


def test_a_split_deployment_prefills_on_one_graph_and_generates_on_the_other(zoo_run):
    """--prefill-recipe: the prompt's logits are the prompt graph's, each new token's the token
    graph's reading the cache the prompt graph wrote; the row is scored and sized as both."""
    from quantnorm.generation import DecodeSession
    from quantnorm.generation.bundle import pick_model
    from quantnorm.report.engines import quantnorm_rows

    results = _results(zoo_run)
    split = _check_models(results, ())[SPLIT].entry
    tokens, prompt = (zoo_run / "model.int8.wo-int8-b32-acc4.past.onnx", zoo_run / "model.int8.pertoken-fused-gptq.past.onnx")
    assert split["split"] == {"tokens": "wo-int8-b32-acc4", "prompt": "pertoken-fused-gptq"}
    assert (split["path"], split["prompt_path"]) == (tokens.name, prompt.name)
    assert split["size_bytes"] == tokens.stat().st_size + prompt.stat().st_size
    assert split["cache_check"]["relative_diff"] < 1e-2   # the cache written by another graph of the same model
    # the weight-only token graph runs each residual add fused with the RMSNorm that reads it (the
    # embeddings' add and the two residuals, as in the one-row graph below), and the report says so
    weight_only = _check_models(results, ())["wo-int8-b32-acc4"].entry
    assert (weight_only["packed_shared_groups"], weight_only["fused_residual_norms"]) == (1, 3)   # q/k/v: not GQA
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in onnx.load(str(tokens)).graph.node) == 3
    assert "`wo-int8-b32-acc4`: packed groups 1, fused norms 3" in (zoo_run / "report.md").read_text()
    # so does FP32's with-past graph once the quantizers have read it, with its cache proof taken again on it
    fp32 = _check_models(results, ())["fp32"].entry
    assert fp32["fused_residual_norms"] == 3 and fp32["cache_check"]["ok"]
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization"
               for n in onnx.load(str(zoo_run / fp32["path"]), load_external_data=False).graph.node) == 3
    assert "`fp32`: packed groups 0, fused norms 3" in (zoo_run / "report.md").read_text()

    ids = windows(2, 10, 256)
    runner = DecodeSession(tokens, prompt_model=prompt, shared_cache=False)
    assert runner.split and all(s.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
                                for s in (runner.tokens_graph.session, runner.prompt_graph.session))
    runner.reset(2)
    first, second = runner.step(ids[:, :8]), runner.step(ids[:, 8:9])
    alone = DecodeSession(prompt, shared_cache=False)
    alone.reset(2)
    np.testing.assert_array_equal(first, alone.step(ids[:, :8]))
    session = ort.InferenceSession(str(tokens))
    feed = {"input_ids": ids[:, 8:9], "attention_mask": np.ones((2, 9), np.int64), "position_ids": np.full((2, 1), 8)}
    feed.update(zip([f"past_key_values.{i // 2}.{('key', 'value')[i % 2]}" for i in range(2 * runner.layout.n_layers)],
                    alone.cache()))
    feed = {k: v for k, v in feed.items() if k in {i.name for i in session.get_inputs()}}
    np.testing.assert_allclose(second, session.run(["logits"], feed)[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(second, alone.step(ids[:, 8:9]), atol=1e-7)   # not the prompt graph's step

    row = next(r for r in quantnorm_rows(results) if r.format == SPLIT)
    kl = {r["name"]: r["accuracy"]["kld_mean"] for r in results["recipes"]}
    assert row.kld == max(kl["wo-int8-b32-acc4"], kl["pertoken-fused-gptq"]) and row.size_bytes == split["size_bytes"]
    assert row.prompt_tok_s > 0 and row.agreement is not None
    # a bundle takes both graphs (tests/test_bundle.py: ONNX Runtime GenAI's decoder-pipeline)
    assert pick_model(results, SPLIT, zoo_run).entry["prompt_path"] == prompt.name
    assert f"| `{SPLIT}` | 1 |" in (zoo_run / "report.md").read_text()


ONE_ROW = "pertoken-fused-gptq+one-row"


def test_a_per_token_recipe_generates_with_its_one_row_token_graph(zoo_run):
    """P+one-row: a step of one row runs the one-row graph (ORT's rounding of the row, the products
    packed), every other step P's graph exactly; scored through the cache at batch 1, with P's accuracy."""
    from quantnorm.generation import DecodeSession
    from quantnorm.report.engines import quantnorm_rows

    results = _results(zoo_run)
    models = _check_models(results, ())
    entry = models[ONE_ROW].entry
    tokens, prompt = zoo_run / "model.int8.pertoken-fused-gptq.one-row.past.onnx", zoo_run / "model.int8.pertoken-fused-gptq.past.onnx"
    assert (entry["path"], entry["prompt_path"]) == (tokens.name, prompt.name)
    assert entry["size_bytes"] == tokens.stat().st_size + prompt.stat().st_size
    # the tiny model's one layer: q, k and v (one product, then split: its attention is not ORT's
    # GroupQueryAttention, test_one_row.py packs into that), the projection, up, down, the head;
    # three adds read by an RMSNorm (the token and position embeddings, the two residuals)
    assert entry["one_row"] == {"recipe": "pertoken-fused-gptq", "products": 7, "packed_attention_layers": 0,
                                "packed_splits": 1, "residual_norms": 3}
    graph = onnx.load(str(tokens)).graph
    assert not any(n.op_type in ("MatMulIntegerToFloat", "QuantizeLinear") for n in graph.node)
    assert entry["cache_check"]["windows"][0] == 4 and entry["cache_check"]["relative_diff"] < 1e-2
    assert "not applicable" not in models["dynamic"].status and "dynamic+one-row" not in models   # per-token only

    ids = windows(2, 10, 256)
    runner = DecodeSession(tokens, prompt_model=prompt)
    alone = DecodeSession(prompt)
    assert runner.one_row and not alone.one_row
    for batch in (2, 1):
        runner.reset(batch, 10)
        alone.reset(batch, 10)
        np.testing.assert_array_equal(runner.step(ids[:batch, :8]), alone.step(ids[:batch, :8]))
        mine, theirs = runner.step(ids[:batch, 8:9]), alone.step(ids[:batch, 8:9])
        if batch == 2:   # two rows: P's graph, exactly (one scale per tensor would not be per token)
            np.testing.assert_array_equal(mine, theirs)
        else:            # one row: the one-row graph, close to P's and not equal
            assert not np.array_equal(mine, theirs) and np.abs(mine - theirs).max() < 0.1 * np.abs(theirs).max()
    with pytest.raises(ConfigError, match="one-row token graph .* prompt graph"):
        DecodeSession(tokens)
    from quantnorm.generation.bundle import pick_model

    with pytest.raises(ConfigError, match="exact for steps of one row only.*bundle --recipe pertoken-fused-gptq$"):
        pick_model(results, ONE_ROW, zoo_run)   # ORT GenAI's pipeline would run it for batches too

    row = next(r for r in quantnorm_rows(results) if r.format == ONE_ROW)
    assert row.accuracy == next(r["accuracy"] for r in results["recipes"] if r["name"] == "pertoken-fused-gptq")
    assert row.gen_tok_s > 0 and row.agreement is not None and row.size_bytes == entry["size_bytes"]
    report = (zoo_run / "report.md").read_text()
    assert f"| `{ONE_ROW}` | 1 |" in report and "One-row token graphs" in report


def test_a_split_needs_graphs_of_one_model(zoo_run, tmp_path):
    from quantnorm.generation import DecodeSession

    other = export_with_past(ZooWithPast(zoo_model("pre")), tmp_path / "other.onnx", windows(2, 6, 256)).path
    with pytest.raises(ConfigError, match="the prompt graph's cache .* is not the token graph's"):
        DecodeSession(zoo_run / "model.fp32.past.onnx", prompt_model=other)


def test_the_with_past_graph_reads_the_whole_window_gptq_codes(zoo_run):
    """GPTQ is solved once: the with-past graph holds the same weights and is calibrated on the
    same windows, so it reads the whole-window model's codes; the INT8 weights are the same bits."""
    results = _results(zoo_run)
    whole = next(r for r in results["recipes"] if r["name"] == "pertoken-fused-gptq")["settings"]["gptq"]
    past = _check_models(results, ())["pertoken-fused-gptq"].entry["gptq"]
    assert "codes_reused" not in whole and whole["matmuls"] == past["matmuls"] == past["codes_reused"] > 0

    def codes(path):
        return sorted(numpy_helper.to_array(i).tobytes() for i in onnx.load(str(path)).graph.initializer
                      if i.name.endswith("W_quantized"))
    assert codes(zoo_run / "model.int8.pertoken-fused-gptq.onnx") == \
        codes(zoo_run / "model.int8.pertoken-fused-gptq.past.onnx")


def test_a_whole_window_scored_through_an_empty_cache_is_the_whole_window(zoo_run):
    fp32, past = ort.InferenceSession(str(zoo_run / "model.fp32.onnx")), ort.InferenceSession(
        str(zoo_run / "model.fp32.past.onnx"))
    assert is_with_past(past) and not is_with_past(fp32)
    ids = windows(3, 32, 256)
    feed = window_feeder(past)(ids)
    assert sorted(feed) == sorted(i.name for i in past.get_inputs())
    assert feed["past_key_values.0.key"].shape[2] == 0 and (feed["attention_mask"] == 1).all()
    np.testing.assert_allclose(past.run(["logits"], feed)[0], fp32.run(None, {"input_ids": ids})[0], atol=1e-4)
    result = compare(fp32, past, ids, np.roll(ids, -1, axis=1)).to_dict()
    assert abs(result["ppl_ratio"] - 1.0) < 1e-5


def test_no_generation_leaves_the_section_out(tmp_path):
    out = tmp_path / "run"
    assert main(["evaluate", "--placement", "pre", "--norm", "rms", *TINY, *FAST, "--out", str(out),
                 "--recipes", "dynamic", "--providers", "cpu", "--no-generation", "--no-outliers"]) == 0
    assert "generation" not in _results(out) and not (out / "model.fp32.past.onnx").exists()
    assert "## Generation" not in (out / "report.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--gen-tokens", "12"], "--gen-tokens"),
    (["--agreement", "0,8"], "--agreement-prompts must be >= 1"),
    (["--gen-batches", "0"], "--gen-batches must be >= 1"),
    (["--gen-tokens", "12,1"], "--gen-new-tokens must be >= 2"),
    (["--recipes", "dynamic", "--prefill-recipe", "dynamic"], "names no weight-only recipe to generate with"),
    (["--recipes", "dynamic,wo-int8-b32", "--prefill-recipe", "wo-int8-b32"], "name a per-token, dynamic or static"),
    (["--recipes", "dynamic,wo-int8-b32", "--prefill-recipe", "pertoken"], "it is not among --recipes"),
    (["--recipes", "dynamic,wo-int8-b32", "--prefill-recipe", "dynamic", "--no-generation"], "needs generation"),
])
def test_bad_generation_flags_are_one_line(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert main(["evaluate", "--placement", "pre", "--norm", "rms", *TINY, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()


HF_FLAGS = ["--context", "16", "--eval-tokens", "96", "--calib-samples", "4", "--providers", "cpu", *FAST, *GEN]


@pytest.fixture(scope="module")
def hf_run(hf_tiny, tmp_path_factory) -> Path:
    """A pretrained checkpoint's run (no training-status check in the gate). A transform's with-past
    graph from a checkpoint: the rotation's here, SmoothQuant's in zoo_run (the same transform stage
    serves both sources; each with-past export of a checkpoint is ~6 s of the run)."""
    out = tmp_path_factory.mktemp("gen-hf") / "llama"
    assert main(["evaluate", "--model", str(hf_tiny["llama"]), "--out", str(out), "--no-outliers",
                 "--recipes", "pertoken-fused,rotated-pertoken-fused,auto",
                 "--search-space", "rotated-pertoken-fused-gptq", "--max-kld", "1", *HF_FLAGS]) == 0
    return out


def test_hugging_face_checkpoint_and_encoder(hf_run, hf_tiny, tmp_path):
    out = hf_run
    models = _check_models(_results(out), ("pertoken-fused", "rotated-pertoken-fused",
                                           "auto:rotated-pertoken-fused-gptq"))
    assert models["rotated-pertoken-fused"].entry["quantized_from"] == "model.fp32.rotated.past.onnx"
    # the search's pick, on the with-past graph under the file name of its whole-window model
    assert models["auto:rotated-pertoken-fused-gptq"].path == "model.int8.auto.past.onnx"
    # its GPTQ codes were solved once, by the search's trial: the rotated with-past weights are the same bits
    gptq = models["auto:rotated-pertoken-fused-gptq"].entry["gptq"]
    assert gptq["codes_reused"] == gptq["matmuls"] > 0
    export = _results(out)["generation"]["export"]
    assert export["inputs"][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert export["outputs"][1:3] == ["present.0.key", "present.0.value"]

    encoder = tmp_path / "bert"
    assert main(["evaluate", "--model", str(hf_tiny["bert"]), "--out", str(encoder), "--no-outliers",
                 "--recipes", "dynamic", *HF_FLAGS]) == 0
    status = _results(encoder)["generation"]["status"]
    assert status.startswith("not applicable: ") and "encoder" in status
    assert status in (encoder / "report.md").read_text()


def test_onnx_directory_with_its_own_cache(tmp_path):
    """An export directory whose graph takes a KV cache: windows scored through an empty cache,
    every recipe quantized on the graph as given, and the cache proof on the copy."""
    model = zoo_model("pre")
    ids = windows(2, 8, model.cfg.vocab_size)
    past = export_with_past(ZooWithPast(model), tmp_path / "past.onnx", ids)
    directory = write_onnx_dir(past.path, model.cfg, tmp_path / "exported", placement_note={})
    out = tmp_path / "run"
    assert main(["evaluate", "--model", str(directory), "--context", "24", "--eval-tokens", "240", "--out", str(out),
                 "--recipes", "static-minmax-matmul,pertoken-fused,smoothquant", "--providers", "cpu",
                 "--no-outliers", *FAST, "--gen-tokens", "8,8", "--gen-batches", "1,2", "--agreement", "3,6"]) == 0
    results = _results(out)
    assert {r["name"]: r["status"] for r in results["recipes"]}["pertoken-fused"] == "ok"
    models = _check_models(results, ("static-minmax-matmul", "pertoken-fused"), new_tokens=8)
    assert results["generation"]["export"]["exporter"].startswith("the user's")
    assert "smoothquant" not in models   # not applicable to an ONNX export: not in the run, not here either


def test_the_gate_judges_generation_speed_and_agreement(hf_run, tmp_path, capsys):
    run = ["gate", str(hf_run), "--recipe", "pertoken-fused", "--max-ppl-ratio", "1.1", "--max-kld", "1",
           "--min-top1", "0"]
    assert main([*run, "--min-gen-agreement", "0.5", "--min-gen-tokens-per-s", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical_before_divergence" in out and "gen_tokens_per_s CPU b=1" in out
    assert main([*run, "--min-gen-tokens-per-s", "1e12"]) == 1
    assert "not >= 1e+12" in capsys.readouterr().out
    ratio = main([*run, "--min-gen-speed-ratio", "1e-9"])
    assert ratio == 0 and "gen_speed_ratio CPU b=2" in capsys.readouterr().out
    # a run without the section fails closed: the number is missing, never a pass
    results = json.loads((hf_run / "results.json").read_text())
    del results["generation"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["gate", str(tmp_path / "results.json"), "--max-ppl-ratio", "1.1", "--max-kld", "1",
                 "--min-gen-agreement", "0.5"]) == 1
    assert "no generation section" in capsys.readouterr().out


def test_bench_decode_times_with_past_graphs_and_refuses_others(zoo_run, tmp_path, capsys):
    json_out = tmp_path / "decode.json"
    assert main(["bench", "--decode", str(zoo_run / "model.fp32.past.onnx"), str(zoo_run / "model.int8.dynamic.past.onnx"),
                 "--providers", "cpu", "--batches", "1", "--seq", "8", "--new-tokens", "6", "--rounds", "2",
                 "--threads", "1", "--json", str(json_out)]) == 0
    rows = json.loads(json_out.read_text())
    assert [r["model"] for r in rows] == ["model.fp32.past.onnx", "model.int8.dynamic.past.onnx"]
    assert all(r["status"] == "measured" and len(r["round_gen_tokens_per_s"]) == 2 for r in rows)
    assert max(rows[0]["round_gen_tokens_per_s"]) == rows[0]["gen_tokens_per_s"]
    from quantnorm.generation.speed import weights_read_per_step
    out = capsys.readouterr().out
    assert "gen tok/s" in out and "GB/s" in out
    for row, name in zip(rows, ("model.fp32.past.onnx", "model.int8.dynamic.past.onnx")):
        step = weights_read_per_step(zoo_run / name)
        assert row["step_weight_bytes"] == step > 0
        line = next(x for x in out.splitlines() if x.startswith(name)).split()
        assert line[-2:] == [f"{step / 1e6:,.1f}", f"{step * row['gen_tokens_per_s'] / 1e9:.2f}"]
    assert rows[1]["step_weight_bytes"] < rows[0]["step_weight_bytes"]   # int8 weights: fewer bytes than float
    assert main(["bench", "--decode", str(zoo_run / "model.fp32.onnx")]) == 2
    assert "not a with-past causal LM" in capsys.readouterr().err

    # a one-row deployment is a pair: timed with --prompt-model, refused without it
    tokens, prompt = zoo_run / "model.int8.pertoken-fused-gptq.one-row.past.onnx", \
        zoo_run / "model.int8.pertoken-fused-gptq.past.onnx"
    assert main(["bench", "--decode", str(tokens), "--providers", "cpu", "--batches", "1"]) == 2
    assert "--prompt-model" in capsys.readouterr().err
    assert main(["bench", str(tokens), "--prompt-model", str(prompt)]) == 2
    assert "add --decode" in capsys.readouterr().err
    assert main(["bench", "--decode", str(tokens), "--prompt-model", str(tmp_path / "missing.onnx")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["bench", "--decode", str(tokens), "--prompt-model", str(prompt), "--providers", "cpu", "--batches",
                 "1,2", "--seq", "8", "--new-tokens", "6", "--threads", "1", "--json", str(json_out)]) == 0
    rows = json.loads(json_out.read_text())
    pair = f"{tokens.name} (prompt: {prompt.name})"
    assert [(r["model"], r["batch"]) for r in rows] == [(pair, 1), (pair, 2)]
    assert all(r["status"] == "measured" and r["gen_tokens_per_s"] > 0 for r in rows)
    assert rows[0]["step_weight_bytes"] == weights_read_per_step(tokens)
    assert pair in capsys.readouterr().out


def test_a_bundle_reads_back_as_a_model(hf_run, tmp_path):
    """`evaluate --model BUNDLE`: the bundle's INT8 model measured as given (no recipe quantizes it
    again), through its own cache."""
    bundle = tmp_path / "bundle"
    assert main(["bundle", str(hf_run), "--recipe", "pertoken-fused", "--out", str(bundle)]) == 0
    out = tmp_path / "again"
    assert main(["evaluate", "--model", str(bundle), "--out", str(out), "--no-outliers", "--recipes",
                 "dynamic,pertoken-fused", *HF_FLAGS]) == 0
    results = _results(out)
    source = results["model"]["source"]
    assert source["kind"] == "onnx" and source["bundle"]["model"] == "pertoken-fused"
    assert "already quantized by quantnorm" in source["baseline"]
    assert all(r["status"].startswith("not applicable: the bundle's model is already quantized")
               for r in results["recipes"])
    models = _check_models(results, ())
    assert list(models) == ["fp32"]


def test_agreement_is_total_for_the_same_model_and_measures_another(tmp_path):
    from quantnorm.generation.agreement import fp32_continuation, generation_agreement

    prompts = windows(6, 8, 256, seed=1)
    paths = {p: export_with_past(ZooWithPast(zoo_model(p)), tmp_path / f"{p}.onnx", prompts[:2]).path
             for p in ("pre", "post")}
    reference = fp32_continuation(paths["pre"], prompts, 10)
    same = generation_agreement(paths["pre"], reference)
    assert same["identical_before_divergence"] == 1.0 and same["identical_prompts"] == 6
    assert same["kl_mean"] == 0.0 and same["top1_along_fp32"] == 1.0 and same["first_divergence_mean"] == 10
    other = generation_agreement(paths["post"], reference)   # another model: its own text
    assert other["identical_before_divergence"] < 0.5 and other["identical_prompts"] == 0
    assert other["kl_mean"] > 0.01 and other["top1_along_fp32"] < 0.5
    assert other["first_divergence_mean"] == other["identical_before_divergence"] * 10
    assert same["first_divergence"] == [10] * 6 and len(other["first_divergence"]) == 6   # per prompt: a paired test
    assert abs(sum(other["first_divergence"]) / 6 - other["first_divergence_mean"]) < 1e-3


def test_a_sliding_window_shorter_than_the_windows_cuts_what_the_cache_reads(tmp_path):
    """Gemma 3 with a sliding window of 12 keeps 11 keys: its with-past graph is exact up to 11
    positions, so calibration, the cache proof, agreement and decode read no further than that,
    while the whole-window evaluation keeps its 16-token windows."""
    import transformers
    from test_hf import ARCHS, tiny_tokenizer

    config = ARCHS["gemma3_text"][0]()
    config = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": None, "sliding_window": 12})
    assert config.layer_types == ["sliding_attention"]   # one layer, and it slides (the cut is its)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "gemma")
    tiny_tokenizer(False).save_pretrained(tmp_path / "gemma")
    out = tmp_path / "run"
    assert main(["evaluate", "--model", str(tmp_path / "gemma"), "--out", str(out), "--no-outliers",
                 "--recipes", "pertoken-fused", *HF_FLAGS]) == 0
    results = _results(out)
    settings = results["generation"]["settings"]
    assert settings["max_length"] == 11 and results["data"]["window"] == 16
    assert settings["prompt_tokens"] + settings["new_tokens"] <= 11
    assert settings["agreement_prompt_tokens"] + settings["agreement_new_tokens"] <= 11
    models = _check_models(results, ("pertoken-fused",), new_tokens=settings["new_tokens"])
    assert models["fp32"].cache_check["windows"][1] == 11


def test_loops_over_many_positions_hold_a_bounded_slice_of_logits():
    from quantnorm.generation.decode import LOGITS_BUDGET_BYTES, rows_within_budget

    assert rows_within_budget(128, 262_144, 8) == 2     # Gemma 3's vocabulary: two 128-token sequences
    assert rows_within_budget(128, 49_152, 8) == 8      # SmolLM2's: the cap
    assert rows_within_budget(100_000, 262_144, 8) == 1  # never none
    assert rows_within_budget(128, 262_144, 8) * 128 * 262_144 * 4 <= LOGITS_BUDGET_BYTES


def test_a_split_is_refused_where_the_two_graphs_cache_different_values(tmp_path):
    """stream-block-rotated-wo keeps each head's values rotated in its cache (form d folds the
    o-projection's input rotation into them); a per-token prompt graph writes the checkpoint's
    values, which the token graph would read as rotated ones. Refused before any file is read."""
    from quantnorm.generation_stage import split_entries
    from quantnorm.quantize import get_recipe

    tokens, prompt = "stream-block-rotated-wo-int8-b64-acc4-gptq", "rotated-pertoken-fused-gptq"
    recipes = {name: get_recipe(name) for name in (tokens, prompt)}
    models = [{"name": name, "status": "ok", "path": "absent.onnx", "size_bytes": 1} for name in recipes]
    [entry] = split_entries(models, recipes, prompt, np.zeros((1, 8), np.int64), None, tmp_path)
    assert entry["name"] == f"{tokens}+prefill-{prompt}" and entry["status"].startswith("not applicable: ")
    assert "values rotated inside blocks of 64" in entry["status"] and "block-rotated-wo" in entry["status"]
    # form (c) rotates inside each product and caches the checkpoint's values: it pairs with the prompt graph
    assert get_recipe("block-rotated-wo-int8-b64-acc4-gptq").value_cache == recipes[prompt].value_cache
