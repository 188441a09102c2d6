"""GGUF files as a model source (quantnorm.sources.gguf): finding, joining, provenance, end to end.

The files are written in the test with the gguf package's writer (tests/gguf_helpers.py).
"""

import hashlib
import json
from pathlib import Path

import pytest
from gguf_helpers import split_into_parts, write_tiny_gemma3_gguf, write_tiny_llama_gguf

from quantnorm.cli import main
from quantnorm.errors import ConfigError
from quantnorm.sources.gguf import SOURCE_FILE, gguf_checkpoint, is_gguf_path, resolve_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "Tiny-Llama.F32.gguf", layers=1)


@pytest.fixture(scope="module")
def gguf_run(tiny_gguf, tmp_path_factory) -> Path:
    """One `quantnorm evaluate --model FILE.gguf` with the recipes two tests read (per-token and
    dynamic; rotated per-token with and without calibrated norm inputs): one export, FP32 pass and
    probe for both, and the GGUF source's with-past graph (generation, small). The tests only read
    the run."""
    out = tmp_path_factory.mktemp("gguf-run") / "run"
    argv = ["evaluate", "--model", str(tiny_gguf), "--recipes", "pertoken,dynamic,rotated-pertoken-fused,"
            "rotated-pertoken-fused-calnorm", "--context", "16", "--eval-tokens", "96", "--calib-samples", "4",
            "--batches", "1", "--iters", "2", "--providers", "cpu", "--threads", "1", "--out", str(out), "--quiet",
            "--gen-tokens", "8,6", "--gen-batches", "1", "--agreement", "2,4"]
    assert main(argv) == 0
    return out


def test_gguf_paths_are_recognized():
    assert is_gguf_path("a/b/model.gguf") and is_gguf_path("x.gguf.part00")
    assert not is_gguf_path("a/model") and not is_gguf_path("model.gguf.bak")


def test_provenance_of_one_file(tiny_gguf):
    found = resolve_gguf(tiny_gguf)
    prov = found.provenance
    assert found.path == tiny_gguf
    assert prov.kind == "gguf" and prov.file == tiny_gguf.name and prov.parts == ()
    assert prov.sha256 == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert prov.quant_type == "ALL_F32"
    assert prov.package is None and "/" not in json.dumps(prov.to_dict()).replace("\\/", "")


def test_parts_are_joined_once_into_a_cache_named_by_sha(tiny_gguf, tmp_path):
    parts = split_into_parts(tiny_gguf, tmp_path / "parts")
    cache = tmp_path / "cache"
    found = resolve_gguf(parts[0], cache_dir=cache)
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert found.path == cache / "gguf" / f"{sha}.gguf"
    assert found.path.read_bytes() == tiny_gguf.read_bytes()
    assert found.provenance.sha256 == sha and found.provenance.file == tiny_gguf.name
    assert found.provenance.parts == tuple(p.name for p in parts)
    mtime = found.path.stat().st_mtime_ns
    assert resolve_gguf(parts[0], cache_dir=cache).path.stat().st_mtime_ns == mtime  # not joined again


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file"),
    ("not_gguf", "not a GGUF file"),
    ("later_part", "give the first part"),
    ("missing_part", "incomplete"),
])
def test_bad_gguf_inputs_are_one_line_errors(tiny_gguf, tmp_path, case, needle):
    if case == "missing":
        target = tmp_path / "nope.gguf"
    elif case == "not_gguf":
        target = tmp_path / "fake.gguf"
        target.write_bytes(b"PK\x03\x04 not a gguf")
    else:
        parts = split_into_parts(tiny_gguf, tmp_path / "parts")
        if case == "later_part":
            target = parts[1]
        else:
            parts[1].unlink()
            target = parts[0]
    with pytest.raises(ConfigError, match=needle) as info:
        resolve_gguf(target, cache_dir=tmp_path / "cache")
    assert "\n" not in str(info.value)


def test_truncated_gguf_is_refused_before_anything_is_written(tiny_gguf, tmp_path, capsys):
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[: 200])
    out = tmp_path / "run"
    assert main(["evaluate", "--model", str(broken), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "GGUF" in err and len(err.splitlines()) == 1
    assert not (out / "results.json").exists() and not (out / "checkpoint").exists()


def test_checkpoint_is_cached_and_reused(tiny_gguf, tmp_path):
    found = resolve_gguf(tiny_gguf)
    ckpt = gguf_checkpoint(found, tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json", SOURCE_FILE} <= {p.name for p in ckpt.iterdir()}
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    stamp = (ckpt / "model.safetensors").stat().st_mtime_ns
    assert gguf_checkpoint(found, tmp_path) == ckpt
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not converted again


@pytest.mark.parametrize("progress", [False, True])
def test_the_dequantization_bar_follows_progress(tiny_gguf, tmp_path, capfd, progress):
    """transformers draws its GGUF bar whatever its own setting says: --quiet must silence it."""
    gguf_checkpoint(resolve_gguf(tiny_gguf), tmp_path, progress=progress)
    assert ("de-quantizing GGUF tensors" in capfd.readouterr().err) is progress


def test_gguf_end_to_end_through_the_cli(tiny_gguf, gguf_run):
    out = gguf_run
    results = json.loads((out / "results.json").read_text())
    source = results["model"]["source"]
    assert source["kind"] == "gguf" and source["file"] == tiny_gguf.name and source["quant_type"] == "ALL_F32"
    assert "dequantized" in source["baseline"]
    assert results["model"]["architecture"] == "llama" and results["model"]["placement"] == "pre"
    assert results["data"]["n_eval_windows"] == 6  # 96 tokens / 16
    names = {r["name"]: r for r in results["recipes"]}
    acc = names["pertoken"]["accuracy"]
    assert names["pertoken"]["status"] == "ok" and acc["ppl_ratio"] == pytest.approx(acc["ppl_int8"] / acc["ppl_fp32"])
    assert acc["ppl_ratio"] == pytest.approx(1.0, abs=0.05) and 0 < acc["kld_mean"] < 0.05, acc
    assert names["pertoken"]["settings"]["format"].startswith("per-token")
    report = (out / "report.md").read_text()
    assert tiny_gguf.name in report and source["sha256"] in report
    # the GGUF checkpoint generates through its own cache: the FP32 proof and every recipe on it
    generation = {m["name"]: m for m in results["generation"]["models"]}
    assert generation["fp32"]["cache_check"]["relative_diff"] <= 1e-4
    assert all(generation[name]["status"] == "ok" for name in ("pertoken", "dynamic", "rotated-pertoken-fused"))


def test_parts_in_sibling_packages_are_found_through_chunk_paths(tiny_gguf, tmp_path, monkeypatch):
    """The Gemma 3 layout: part k lives in package ``<main>_part<k+1>``, and only the main package
    knows the order (``chunk_paths()``) and the checksum (``EXPECTED_SHA256``)."""
    import importlib

    site = tmp_path / "site-packages"  # portable.owning_distribution looks in installed-package dirs
    parts = split_into_parts(tiny_gguf, tmp_path / "raw", n=2)
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    homes = []
    for k, part in enumerate(parts, 1):
        home = site / f"tinyparts_part{k}" / "data"
        home.mkdir(parents=True)
        (home.parent / "__init__.py").write_text("")
        (home / part.name).write_bytes(part.read_bytes())
        homes.append(home / part.name)
        info = site / f"tinyparts_part{k}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tinyparts-part{k}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(f"tinyparts_part{k}\n")
        (info / "RECORD").write_text(f"tinyparts_part{k}/__init__.py,,\ntinyparts_part{k}/data/{part.name},,\n")
    main_pkg = site / "tinyparts"
    main_pkg.mkdir()
    (main_pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"EXPECTED_SHA256 = {sha!r}\n"
        f"def chunk_paths():\n    return [Path(p) for p in {[str(h) for h in homes]!r}]\n")
    info = site / "tinyparts-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyparts\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("tinyparts\n")
    (info / "RECORD").write_text("tinyparts/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    found = resolve_gguf(homes[0], cache_dir=tmp_path / "cache")
    assert found.provenance.sha256 == sha and found.path.read_bytes() == tiny_gguf.read_bytes()
    assert (found.provenance.package, found.provenance.package_version) == ("tinyparts", "1.0")
    # A checksum the package does not expect is refused.
    (main_pkg / "__init__.py").write_text((main_pkg / "__init__.py").read_text().replace(sha, "0" * 64))
    monkeypatch.delitem(__import__("sys").modules, "tinyparts", raising=False)
    with pytest.raises(ConfigError, match="SHA-256"):
        resolve_gguf(homes[0], cache_dir=tmp_path / "cache2")


@pytest.mark.parametrize("case", ["truncated_config", "corrupt_safetensors", "truncated_safetensors"])
def test_corrupt_checkpoint_files_are_refused_before_anything_is_written(tmp_path, capsys, case):
    """A Hugging Face directory whose config.json or model.safetensors is cut or garbage: one line,
    exit 2, and the run directory holds no results.json, report or model."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path / "ckpt"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    from test_hf import tiny_tokenizer

    tiny_tokenizer(False).save_pretrained(path)
    if case == "truncated_config":
        text = (path / "config.json").read_text()
        (path / "config.json").write_text(text[: len(text) // 2])
    elif case == "corrupt_safetensors":
        (path / "model.safetensors").write_bytes(b"\x00" * 64)
    else:
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "run"
    capsys.readouterr()  # the setup's own progress output
    assert main(["evaluate", "--model", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert not any(out.glob("results.json")) and not any(out.glob("report.md")) and not any(out.glob("*.onnx"))


def test_gemma3_gguf_end_to_end_peri_detected_on_the_graph(tmp_path, capsys):
    """Gemma 3's layout (QK-norm, four norms a block, norm weights stored as 1 + w): the table and the
    graph both read Peri-RMSNorm, and the online rotation recipe applies (the stream one does not)."""
    gguf_file = write_tiny_gemma3_gguf(tmp_path / "Tiny-Gemma3.F32.gguf", layers=1)
    out = tmp_path / "run"
    argv = ["evaluate", "--model", str(gguf_file), "--recipes", "pertoken,rotated-pertoken,online-rotated-pertoken-fused",
            "--context", "16", "--eval-tokens", "64", "--calib-samples", "4", "--batches", "1", "--iters", "2",
            "--providers", "cpu", "--threads", "1", "--out", str(out), "--quiet", "--no-outliers", "--no-generation"]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    model = results["model"]
    assert model["architecture"] == "gemma3_text" and (model["placement"], model["norm"]) == ("peri", "rms")
    assert model["placement_detected"]["placement"] == "peri" and model["placement_detected"]["agrees"]
    recipes = {r["name"]: r for r in results["recipes"]}
    assert recipes["pertoken"]["status"] == "ok"
    assert recipes["rotated-pertoken"]["status"].startswith("not applicable") and "Peri-LN" in \
        recipes["rotated-pertoken"]["status"]
    assert recipes["online-rotated-pertoken-fused"]["status"] == "ok"
    assert results["rotation"]["online"]["onnx_vs_original_max_rel_diff"] < 1e-3


def test_calibrated_norm_inputs_end_to_end_on_a_rotated_llama(gguf_run):
    """rotated-pertoken-fused-calnorm on a Pre-RMSNorm checkpoint: the norm outputs the graph shows
    (two per block and the final norm) get one calibrated scale each, within the bound of a row of
    RMS 1 (sqrt(width)); the o- and down-projection inputs stay per token."""
    import onnx

    out = gguf_run
    recipes = {r["name"]: r for r in json.loads((out / "results.json").read_text())["recipes"]}
    cal = recipes["rotated-pertoken-fused-calnorm"]
    assert cal["status"] == "ok" and 0 < cal["accuracy"]["kld_mean"] < 0.05, cal["accuracy"]
    tensors = cal["settings"]["norm_input_scales"]["tensors"]
    assert len(tensors) == 2 * 1 + 1 and all(t["norm"] == "rms" for t in tensors.values())
    width = 32  # the tiny Llama's d_model: every calibrated input here is a d-wide norm output
    assert all(0 < t["clip"] <= t["max_abs"] <= width ** 0.5 * 1.001 for t in tensors.values())
    assert cal["settings"]["calibrated_scale_inputs"] == sorted(tensors)
    nodes = onnx.load(str(out / cal["path"])).graph.node
    quantizers = [n for n in nodes if n.op_type == "QuantizeLinear"]
    per_tensor = [n for n in quantizers if not any(a.name == "axis" for a in n.attribute)]
    assert {n.input[0] for n in per_tensor} == set(tensors)
    assert len(quantizers) - len(per_tensor) == 2 * 1   # o- and down-projection inputs, per row (one block)
    assert "norm_input_scales" not in recipes["rotated-pertoken-fused"]["settings"]
