"""End to end on the smallest real pipeline: train -> export -> quantize -> measure -> report."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantnorm.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "8", "--steps", "40"]
# --no-generation: these tests read the whole-window stages; tests/test_generation_stage.py covers generation
FAST = ["--batches", "1", "--iters", "2", "--calib-samples", "8", "--quiet", "--no-generation"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run"
    code = main(["evaluate", "--placement", "pre", "--norm", "rms", *TINY, *FAST, "--out", str(out),
                 "--recipes", "static-minmax-matmul,dynamic", "--providers", "cpu,cuda"])
    assert code == 0
    before = _files(out)
    yield out
    # a test that writes here would make the others depend on the order: they must use `scratch`
    assert _files(out) == before, "a test changed the shared evaluated run; give it the scratch fixture"


@pytest.fixture
def scratch(evaluated, tmp_path):
    """A private copy of the evaluated run for a test that evaluates or reports into it again: the
    shared run stays as the first evaluation wrote it, whatever order the tests run in."""
    return Path(shutil.copytree(evaluated, tmp_path / "run"))


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_results_follow_the_contract(evaluated):
    results = json.loads((evaluated / "results.json").read_text())
    for key in ("schema_version", "quantnorm_version", "command", "created", "hardware", "model", "data",
                "train", "export", "recipes", "latency", "outliers", "sqnr"):
        assert key in results, key
    assert results["schema_version"] == 2
    # 40 steps of a 32-wide model do not leave the unigram plateau (builtin:pydoc, 4.69 bits/byte)
    assert results["train"]["status"] == "collapsed"
    assert results["train"]["unigram_bits_per_byte"] == pytest.approx(4.688, abs=0.01)
    d = results["data"]
    assert d["calibration"][1] <= d["evaluation"][0] and d["bos"] is True and d["window"] == 32
    assert {r["name"] for r in results["recipes"]} == {"static-minmax-matmul", "dynamic"}
    for r in results["recipes"]:
        acc = r["accuracy"]
        assert set(acc) >= {"ppl_fp32", "ppl_int8", "ppl_ratio", "kld_mean", "kld_p99", "kld_max", "top1_agreement"}
        # INT8 differs from FP32 (KL > 0) but little on this model; perplexity ratio as FORMULAS.md
        assert 0 < acc["kld_mean"] <= acc["kld_p99"] <= acc["kld_max"] and acc["kld_mean"] < 0.05
        assert 0.9 < acc["top1_agreement"] <= 1
        assert acc["ppl_ratio"] == pytest.approx(acc["ppl_int8"] / acc["ppl_fp32"], rel=1e-6)
        assert acc["ppl_ratio"] == pytest.approx(1.0, abs=0.05)
        assert (evaluated / r["path"]).is_file()
        assert r["session"]["graph_optimization_level"] == "ORT_ENABLE_ALL"
    cpu = [row for row in results["latency"] if row["provider"] == "CPUExecutionProvider"]
    assert {row["variant"] for row in cpu} == {"fp32", "static-minmax-matmul", "dynamic"}
    assert all(row["status"] == "measured" and row["p50_ms"] > 0 for row in cpu)
    cuda = [row for row in results["latency"] if row["provider"] == "CUDAExecutionProvider"]
    assert cuda and all(row["status"].startswith("not measured") and "p50_ms" not in row for row in cuda)
    assert len(results["outliers"]["residual"]) == 2  # embed + 1 block
    assert results["sqnr"]["static-minmax-matmul"]
    # the FP32 outputs replayed to every recipe's scoring are deleted with the run's end
    assert not list(evaluated.glob(".fp32-outputs-*"))
    assert len({r["accuracy"]["ppl_fp32"] for r in results["recipes"]}) == 1


def test_report_and_plots(scratch, capsys):
    report = (scratch / "report.md").read_text()
    assert "## INT8 recipes" in report and "not measured" in report and "static-minmax-matmul" in report
    assert report.splitlines()[2].startswith("**Training status: ")   # the status comes first
    for line in report.splitlines():
        if line.startswith("!["):
            assert (scratch / line.split("](")[1].rstrip(")")).is_file()
    (scratch / "report.md").unlink()
    assert main(["report", str(scratch)]) == 0
    assert (scratch / "report.md").read_text() == report


def test_accuracy_recomputes_independently(evaluated):
    """tools/recompute_accuracy.py follows FORMULAS.md without quantnorm; it must agree within 0.5%."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "recompute_accuracy.py"),
                           str(evaluated / "results.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--recipes", "nonsense"], "unknown recipe"),
    (["--providers", "tpu"], "unknown execution provider"),
    (["--calib-samples", "0"], "calib-samples"),
    (["--calib-samples", "100000"], "calibration"),
])
def test_evaluate_bad_input(scratch, capsys, args, message):
    before = _files(scratch)
    assert main(["evaluate", "--checkpoint", str(scratch), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert _files(scratch) == before  # refused before anything was written


def test_checkpoint_must_be_a_run_dir(tmp_path, capsys):
    assert main(["evaluate", "--checkpoint", str(tmp_path)]) == 2
    assert "not a trained run directory" in capsys.readouterr().err


def test_bench_rejects_corrupt_onnx(evaluated, tmp_path, capsys):
    good = (evaluated / "model.fp32.onnx").read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(good[: len(good) // 2])
    assert main(["bench", str(bad), "--providers", "cpu", "--iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "truncated.onnx" in err and len(err.splitlines()) == 1


def test_evaluate_reuses_the_checkpoint_and_exclude_keeps_matching_nodes_in_fp32(scratch):
    """--checkpoint evaluates the trained run again without touching its weights; --exclude keeps
    the matching nodes in FP32."""
    import onnx

    weights = (scratch / "model.safetensors").read_bytes(), (scratch / "model.safetensors").stat().st_mtime_ns
    assert main(["evaluate", "--checkpoint", str(scratch), *FAST, "--recipes", "static-minmax-matmul",
                 "--providers", "cpu", "--no-outliers", "--exclude", "head/*"]) == 0
    assert ((scratch / "model.safetensors").read_bytes(), (scratch / "model.safetensors").stat().st_mtime_ns) == weights
    results = json.loads((scratch / "results.json").read_text())
    (entry,) = results["recipes"]   # it did evaluate again: only this recipe
    assert entry["name"].startswith("static-minmax-matmul-mixed-") and entry["settings"]["excluded_nodes"]
    graph = onnx.load(str(scratch / entry["path"])).graph
    head = [n for n in graph.node if n.name == "head/MatMul"][0]
    producers = {o: n.op_type for n in graph.node for o in n.output}
    assert all(producers.get(i) != "DequantizeLinear" for i in head.input)  # the head stays FP32
    assert main(["evaluate", "--checkpoint", str(scratch), *FAST, "--recipes", "dynamic", "--providers", "cpu",
                 "--no-outliers", "--exclude", "no-such-node*"]) == 2


def test_smoothquant_at_several_alphas_side_by_side(scratch):
    """smoothquant@ALPHA: one smoothed export per alpha, each recipe at its own alpha (an explicit
    @ALPHA keeps it under --sq-alpha), a per-alpha table in the report."""
    assert main(["evaluate", "--checkpoint", str(scratch), *FAST, "--recipes", "smoothquant@0.8,smoothquant",
                 "--sq-alpha", "0.6", "--providers", "cpu", "--no-outliers"]) == 0
    results = json.loads((scratch / "results.json").read_text())
    got = {r["name"]: r["settings"]["smoothquant_alpha"] for r in results["recipes"]}
    assert got == {"smoothquant@0.8": 0.8, "smoothquant": 0.6}
    assert all(r["status"] == "ok" and r["accuracy"]["ppl_ratio"] == pytest.approx(1.0, abs=0.05)
               for r in results["recipes"])
    assert [e["alpha"] for e in results["smoothquant"]["per_alpha"]] == [0.8, 0.6]   # recipe order, not sorted
    assert len({e["path"] for e in results["smoothquant"]["per_alpha"]}) == 2
    report = (scratch / "report.md").read_text()
    assert "Per alpha" in report and "| 0.8 | `smoothquant@0.8` |" in report


@pytest.mark.parametrize("name, message", [("dynamic@0.5", "only SmoothQuant recipes take @ALPHA"),
                                           ("smoothquant@x", "is not a number"),
                                           ("smoothquant@1.5", "must be in [0, 1]")])
def test_a_bad_alpha_is_one_line(scratch, capsys, name, message):
    assert main(["evaluate", "--checkpoint", str(scratch), *FAST, "--recipes", name, "--no-outliers"]) == 2
    assert message in capsys.readouterr().err
