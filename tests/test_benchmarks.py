"""benchmarks/evaluate_budget.py: one tiny evaluate run measured per stage against a budget."""

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "evaluate_budget.py"
TINY = ["--placement", "pre", "--norm", "rms", "--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32",
        "--batch-size", "8", "--steps", "5", "--batches", "1", "--iters", "2", "--calib-samples", "8",
        "--recipes", "dynamic", "--no-outliers", "--no-generation", "--providers", "cpu", "--quiet", "--threads", "1"]


def test_evaluate_budget_reports_stages_and_a_missed_budget(tmp_path, small_corpus):
    """The stage table and both budgets' verdicts; the run itself is the smallest there is (a 40 kB
    corpus, 5 steps): only its stages and its memory are read."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--budget-min", "0.0001", "--budget-gb", "1000",
                          "--interval", "0.1", "--", *TINY, "--corpus", str(small_corpus),
                          "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 1, run.stderr[-2000:]     # the wall-time budget of 6 ms is missed
    out = run.stdout
    assert "| stage | seconds | peak RSS (GB) |" in out and "| export |" in out and "| quantize:dynamic |" in out
    assert "| wall time (min) |" in out and "| missed |" in out and "| peak RSS (GB) |" in out
    peak_row = next(line for line in out.splitlines() if line.startswith("| peak RSS (GB) |"))
    assert peak_row.endswith("| met |") and float(peak_row.split("|")[2]) > 0.05


def test_evaluate_budget_stopped_mid_run_stops_its_evaluate(tmp_path, small_corpus):
    """SIGTERM to the benchmark while its evaluate runs: the evaluate goes too (a real signal to
    real processes), and its run directory is not left half-written."""
    import os
    import signal
    import time

    bench = subprocess.Popen([sys.executable, str(SCRIPT), "--", *TINY, "--corpus", str(small_corpus),
                              "--out", str(tmp_path / "run")], cwd=ROOT)
    children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children")
    deadline = time.monotonic() + 60
    while not (children.is_file() and children.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = [int(c) for c in children.read_text().split()]
    time.sleep(1.0)   # the evaluate is importing torch or training: mid-run
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    try:
        os.kill(child, 0)
        stat = Path(f"/proc/{child}/stat")
        assert stat.is_file() and stat.read_text().split()[2] == "Z", f"the evaluate {child} outlived its benchmark"
    except ProcessLookupError:
        pass   # gone, as it should be
    assert not (tmp_path / "run" / "results.json").exists()


def test_evaluate_budget_needs_the_evaluate_arguments_after_a_separator():
    run = subprocess.run([sys.executable, str(SCRIPT), "--budget-min", "1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "after `--`" in run.stderr


def test_pertoken_kernel_benchmark_prints_both_tables():
    script = ROOT / "benchmarks" / "pertoken_kernel.py"
    run = subprocess.run([sys.executable, str(script), "--threads", "1", "--iters", "1"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith(("| Linear", "| row max"))]   # the data rows, not the headers
    gemm_rows = [r for r in rows if " x " in r.split("|")[2]]
    assert len(gemm_rows) == 5 and all(float(r.split("|")[3]) > 0 and float(r.split("|")[4]) > 0 for r in gemm_rows)
    assert sum(r.startswith("| K = ") for r in rows) == 2


def test_attention_fusion_benchmark_times_both_forms_of_a_checkpoint(tmp_path):
    """A tiny llama checkpoint: exported as exported and fused (each through the parity gate),
    quantized per token, timed side by side (the fused graph with a fresh present per step and
    with the shared buffer); the table has a ratio and the cache mode for each fused row."""
    import pytest

    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    script = ROOT / "benchmarks" / "attention_fusion.py"
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "tiny"), "--recipes", "pertoken-fused,wo-int8-b32-acc4",
                          "--rounds", "1", "--prompt", "8", "--new", "4", "--threads", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "export fused: com.microsoft.GroupQueryAttention in 2 of 2 layers" in out
    assert "export as exported: as exported (standard ONNX operators)" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()
            if line.startswith(("fp32 (", "pertoken-fused (", "wo-int8-b32-acc4 ("))}
    assert len(rows) == 11   # 3 graphs x 3 forms, and the two quantized graphs with q, k, v packed
    for name in ("wo-int8-b32-acc4", "pertoken-fused"):
        assert rows[f"{name} (fused, packed qkv, shared buffer)"].rstrip().endswith("x  shared buffer")
    assert "fp32 (fused, packed qkv, shared buffer)" not in rows   # nothing quantized to pack
    assert rows["pertoken-fused (fused, shared buffer)"].rstrip().endswith("x  shared buffer")
    assert rows["pertoken-fused (fused, present per step)"].rstrip().endswith("x  present per step")
    assert rows["fp32 (as exported)"].rstrip().endswith("present per step")
    assert "CPU:" in out and "threads: 1" in out

    missing = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
    assert missing.returncode == 2 and "no checkpoint/config.json" in missing.stderr


def _graph(path, nodes, inits, inputs=None, outputs=("logits",)):
    """Token ids in, logits (and a with-past graph's presents) out."""
    from onnx import TensorProto, helper, save

    inputs = inputs or [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                   for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    save(model, str(path))
    return path


def test_avx2_instruction_counts_show_the_u8s8_kernel_saturating_under_valgrind(tmp_path):
    """An embedding and one 8-bit per-token GEMM: in FP32 as a whole-window graph, in INT8 with a
    cache. valgrind's CPU has no VNNI whatever this machine has, so the signed form saturates there
    (its KL against the FP32 graph, run on this machine, far above the unsigned form's); every count
    is read from a callgrind dump; the whole-window graph is fed the window and a one-token window,
    the with-past one a prompt after an empty cache (logits at its last position) and a token after
    the prompt's cache."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    vocab, k, n, head = 32, 64, 16, 4
    embedding = rng.uniform(0.0, 1.0, (vocab, k)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)      # most past +-64: the u8 x s8 kernel saturates
    scales = np.full(n, 0.01, np.float32)
    weights = [numpy_helper.from_array(embedding, "embedding"), numpy_helper.from_array(codes, "codes"),
               numpy_helper.from_array(scales, "scales")]
    embed = helper.make_node("Gather", ["embedding", "input_ids"], ["x"])

    def int8_head(x):
        return [helper.make_node("DynamicQuantizeLinear", [x], ["xq", "x_scale", "x_zp"]),
                helper.make_node("MatMulIntegerToFloat", ["xq", "codes", "x_scale", "scales", "x_zp"], ["logits"],
                                 domain="com.microsoft")]

    fp32 = _graph(tmp_path / "fp32.onnx", [embed, helper.make_node("MatMul", ["x", "weight"], ["logits"])],
                  [numpy_helper.from_array(embedding, "embedding"),
                   numpy_helper.from_array(codes.astype(np.float32) * scales, "weight")])
    # with a cache: one layer's keys and values (a projection of x) appended to the past; the head
    # reads the last logits_to_keep positions (0: every one)
    past = [helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, [1, 1, None, head])
            for kv in ("key", "value")]
    int8_past = _graph(
        tmp_path / "int8.past.onnx",
        [embed, helper.make_node("MatMul", ["x", "project"], ["kv_flat"]),
         helper.make_node("Unsqueeze", ["kv_flat", "one"], ["kv"]),
         *[helper.make_node("Concat", [f"past_key_values.0.{kv}", "kv"], [f"present.0.{kv}"], axis=2)
           for kv in ("key", "value")],
         helper.make_node("Neg", ["logits_to_keep"], ["start"]),
         helper.make_node("Slice", ["x", "start", "end", "one"], ["x_kept"]), *int8_head("x_kept")],
        [*weights, numpy_helper.from_array(rng.normal(size=(k, head)).astype(np.float32), "project"),
         numpy_helper.from_array(np.ones(1, np.int64), "one"), numpy_helper.from_array(np.zeros(1, np.int64),
                                                                                         "logits_to_keep"),
         numpy_helper.from_array(np.asarray([1 << 30], np.int64), "end")],
        inputs=[helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None]),
                helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, None]),
                helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, None]), *past,
                helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1])],
        outputs=("logits", "present.0.key", "present.0.value"))
    script = ROOT / "benchmarks" / "avx2_instructions.py"
    run = subprocess.run([sys.executable, str(script), str(fp32), str(int8_past), "--reference", str(fp32),
                          "--prompt", "4"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == ["| model", "weights", "prompt (4 tokens)", "x first", "one new token", "x first",
                       "KL vs fp32.onnx (prompt) |"]
    labels = [(row[0], row[1]) for row in rows[1:]]
    assert labels == [("| fp32.onnx", "as written"), ("| int8.past.onnx", "signed (u8 x s8)"),
                      ("| int8.past.onnx", "unsigned (u8 x u8, 1 GEMMs)")]
    counts = [[float(cell.rstrip(" M|").replace(",", "")) for cell in row[2:]] for row in rows[1:]]
    assert all(0 < row[0] < 100 and 0 < row[2] < 100 for row in counts)   # millions: a tiny graph's, not a wrapped delta
    assert counts[0][1] == counts[0][3] == 1.0 and counts[0][4] < 1e-6   # FP32 under valgrind: the same logits
    assert counts[1][4] > 10 * counts[2][4]          # the prompt's last position (logits_to_keep = 1)
    assert "no VNNI" in run.stdout

    bad = subprocess.run([sys.executable, str(script), str(fp32), str(tmp_path / "none.onnx")], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "no such ONNX file" in bad.stderr
    (tmp_path / "notes.txt").write_text("not a graph")
    bad = subprocess.run([sys.executable, str(script), str(fp32), str(tmp_path / "notes.txt")], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "notes.txt: not an ONNX graph" in bad.stderr and "Traceback" not in bad.stderr


def _floor_output(script: str, args: list[str], refused: list[list[str]]) -> str:
    """A floor benchmark's output for ``args``; each of ``refused`` exits 2 with a one-line error."""
    path = ROOT / "benchmarks" / script
    run = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for bad in refused:
        no = subprocess.run([sys.executable, str(path), *bad], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert no.returncode == 2 and "error:" in no.stderr and "Traceback" not in no.stderr
    return run.stdout


def test_step_floor_benchmark_sums_products_head_and_attention_per_kind():
    out = _floor_output("step_floor.py", ["--model", "smollm2", "--cache", "32", "--threads", "1", "--iters", "1",
                                          "--llamacpp-gen-tps", "100"],
                        [["--cache", "0"], ["--llamacpp-gen-tps", "0"], ["--model", "llama"], ["--blocks", "48"],
                         ["--blocks", "32,x"]])
    assert "30 layers, vocabulary 49,152, one row against a cache of 32" in out and "1 threads" in out
    attention = float(out.split("ms x 30 layers")[0].rsplit(", ", 1)[1])
    for kind in ("one-row", "weight-only b32", "weight-only b128"):
        table = out.split(f"| {kind} product")[1].split("\n\n")[0].splitlines()
        rows = [line.split("|") for line in table if line.startswith("| ") and "---" not in line]
        parts = [float(r[4]) for r in rows if r[1].strip() != "all products"]
        total = float(next(r for r in rows if r[1].strip() == "all products")[4].strip(" *"))
        assert len(parts) == 5 and abs(total - sum(parts)) < 0.03   # four layer products and the head, rounded
        head_mb = float(next(r for r in rows if r[1].strip() == "LM head")[5])
        assert head_mb >= 576 * 49152 / 1e6   # int8 codes at least (weight-only adds a scale per 32)
        floor = float(out.split(f"floor, {kind}: products + attention = ")[1].split(" ms")[0])
        assert abs(floor - (total + attention)) < 0.03
        ratio = float(out.split(f"the {kind} floor is ")[1].split("x that")[0])
        assert abs(ratio - floor / 10.0) < 0.01


def test_prompt_floor_benchmark_sums_its_parts_into_the_floor():
    out = _floor_output("prompt_floor.py", ["--model", "gemma3", "--tokens", "16", "--threads", "1", "--iters", "1",
                                            "--llamacpp-prompt-tps", "1000"],
                        [["--tokens", "0"], ["--llamacpp-prompt-tps", "-5"], ["--model", "llama"]])
    assert "18 layers, 16-token prompt" in out and "threads" in out.splitlines()[0]
    total = float(out.split("| all | | | **")[1].split("**")[0])
    attention = {line.split("|")[1].strip(): float(line.split("|")[3]) for line in out.splitlines()
                 if line.startswith("| ") and line.split("|")[1].strip().startswith(
                     ("GroupQueryAttention", "Attention", "MultiHeadAttention", "standard"))}
    assert len(attention) == 4 and all(v > 0 for v in attention.values())
    blocked = float(next(line for line in out.splitlines() if line.startswith("| blocked")).split("|")[4])
    floor_line = next(line for line in out.splitlines() if line.startswith("floor:"))
    floor = float(floor_line.split(" = ")[1].split(" ms")[0])
    # the floor is the products, the fastest attention and the blocked quantizers, as printed (rounded)
    assert abs(floor - (total + min(attention.values()) + blocked)) < 0.25   # four figures rounded to 0.1
    allowed = 16 / 2000 * 1e3
    ratio = float(out.split("the floor is ")[1].split("x that")[0])
    assert f"allows {allowed:.1f} ms" in out and abs(ratio - floor / allowed) < 0.02
