"""Recompute every accuracy figure of a results.json from the ONNX files and byte ranges alone.

Run:  python tools/recompute_accuracy.py runs/<name>/results.json

Deliberately independent of quantnorm (numpy + onnxruntime only): it follows shared FORMULAS.md
from the recorded keys, so a mismatch means quantnorm's measurement or its record is wrong.
Prints recorded vs recomputed per recipe and exits 1 when any figure differs by more than 0.5%.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

TOLERANCE = 0.005
BOS = 256


def corpus_bytes(source: str) -> bytes:
    if source == "builtin:pydoc":
        import pydoc_data.topics

        return "".join(pydoc_data.topics.topics.values()).encode("utf-8")
    path = Path(source)
    if path.is_dir():
        return b"\n".join(p.read_bytes() for p in sorted(q for q in path.rglob("*") if q.is_file()))
    return path.read_bytes()


def windows(data: np.ndarray, start: int, end: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    starts = [s for s in range(start, end, window) if s + window <= end]
    targets = np.stack([data[s:s + window] for s in starts]).astype(np.int64)
    inputs = np.concatenate([np.full((len(starts), 1), BOS, dtype=np.int64), targets[:, :-1]], axis=1)
    return inputs, targets


def log_probs(session: ort.InferenceSession, inputs: np.ndarray, batch: int = 16) -> np.ndarray:
    out = []
    for i in range(0, len(inputs), batch):
        logits = session.run(["logits"], {"input_ids": inputs[i:i + batch]})[0].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return np.concatenate(out)


def main(results_path: str) -> int:
    results_path = Path(results_path)
    run_dir = results_path.parent
    results = json.loads(results_path.read_text())
    d = results["data"]
    raw = corpus_bytes(d["corpus"])
    if hashlib.sha256(raw).hexdigest() != d["sha256"]:
        print("corpus sha256 differs from the recorded one")
        return 1
    inputs, targets = windows(np.frombuffer(raw, dtype=np.uint8), *d["evaluation"], d["window"])
    scored = slice(d["scored_from"], None)
    worst = 0.0
    for recipe in results["recipes"]:
        if "accuracy" not in recipe:
            continue
        opts = ort.SessionOptions()
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, recipe["session"]["graph_optimization_level"])
        providers = [recipe["session"]["provider"]]
        lp32 = log_probs(ort.InferenceSession(str(run_dir / results["export"]["path"]), opts, providers=providers), inputs)
        lp8 = log_probs(ort.InferenceSession(str(run_dir / recipe["path"]), opts, providers=providers), inputs)
        lp32, lp8, tg = lp32[:, scored], lp8[:, scored], targets[:, scored]
        nll32 = -np.take_along_axis(lp32, tg[..., None], -1).mean()
        nll8 = -np.take_along_axis(lp8, tg[..., None], -1).mean()
        kl = (np.exp(lp32) * (lp32 - lp8)).sum(-1).ravel()
        mine = {"ppl_fp32": np.exp(nll32), "ppl_int8": np.exp(nll8), "ppl_ratio": np.exp(nll8 - nll32),
                "kld_mean": kl.mean(), "kld_p99": np.percentile(kl, 99), "kld_max": kl.max(),
                "top1_agreement": (lp32.argmax(-1) == lp8.argmax(-1)).mean()}
        for key, value in mine.items():
            recorded = recipe["accuracy"][key]
            # KL figures are tiny: compare them with an absolute floor as well.
            rel = abs(recorded - value) / max(abs(value), 1e-6 if not key.startswith("kld") else 1e-4)
            worst = max(worst, rel)
            flag = "" if rel <= TOLERANCE else "  <-- differs"
            print(f"{recipe['name']:<34} {key:<15} recorded {recorded:.6g}  recomputed {value:.6g}{flag}")
    print(f"largest relative difference: {100 * worst:.3f}% (tolerance {100 * TOLERANCE:.1f}%)")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
