"""Does a per-token INT8 model score the same on a CPU without VNNI? KL of its logits against FP32's.

    python benchmarks/kernel_parity.py runs/vs-smollm2 --recipe online-rotated-pertoken-fused-gptq
    # the same on a CPU without AVX512/VNNI, or emulated here (qemu-user, a Haswell: AVX2 only):
    qemu-x86_64 -cpu Haswell "$(command -v python3)" benchmarks/kernel_parity.py runs/vs-smollm2 ...

Reads a finished run (its checkpoint directory, ``model.fp32[.<transform>].onnx`` and the recipe's
``model.int8.<recipe>.onnx``), scores the first ``--windows`` evaluation windows of the built-in
corpus and prints, for the recipe's weights stored two ways, the mean KL(FP32 || INT8) per
position on this CPU:

- ``signed``: int8 codes (the u8 x s8 kernel: what the quantize stage writes on a VNNI CPU);
- ``unsigned``: the same codes + 128 with a zero point of 128 (the u8 x u8 kernel: what it writes
  on a CPU without VNNI, and what ``make_session`` runs there from a signed file; made here from
  the signed file, code for code).

On a VNNI CPU both rows match; without VNNI the signed row saturates (ORT's AVX2 u8 x s8 kernel
sums pairs of products in int16) and the unsigned row should still match the VNNI figure. The goal
(issue 33): a recipe's KL without VNNI within 1.25x of its KL with VNNI. Prints the CPU and its
flags (from /proc/cpuinfo: an emulator shows the CPU it emulates there only if told to).
``--speed-rounds N`` times one window through both forms too (interleaved, median): what storing
the codes unsigned costs (``quantnorm bundle --int8-weights unsigned``; the session rewrite on a
CPU without VNNI).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from quantnorm.hardware import cpu_flags, cpu_has_vnni, cpu_model
from quantnorm.measure.accuracy import pair_stats, run_logits
from quantnorm.measure.sessions import SessionSpec, make_session
from quantnorm.sources.hf_loader import load_tokenizer
from quantnorm.sources.tokenized import prepare_hf_data
from quantnorm.unsigned_weights import to_unsigned


def unsigned_copy(signed: Path, out: Path) -> int:
    """``signed`` with its int8 weight codes stored unsigned (``quantnorm.unsigned_weights``: what
    a session on a CPU without VNNI runs); returns how many products were converted."""
    model = onnx.load(str(signed))
    converted = to_unsigned(model)
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data")
    return converted


def kl_against(fp32_logits: list[np.ndarray], path: Path, windows: np.ndarray, targets: np.ndarray,
               threads: int) -> float:
    session = make_session(path, SessionSpec(threads=threads), exact_int8=False)   # the file's own weights
    kls = [pair_stats(reference, got, targets[i:i + 1])[2]
           for i, (reference, got) in enumerate(zip(fp32_logits, run_logits(session, windows, batch_size=1)))]
    return float(np.mean(np.concatenate([np.ravel(k) for k in kls])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished `quantnorm evaluate --model ...` run directory")
    parser.add_argument("--recipe", required=True, help="a recipe of that run (per-token: both weight forms)")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows scored (default 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-rounds", type=int, default=0,
                        help="also time one window through each weight form, interleaved rounds (default 0: off): "
                             "what storing the codes unsigned costs on this CPU")
    args = parser.parse_args()
    if not (args.run / "results.json").is_file() or not (args.run / "checkpoint").is_dir():
        parser.error(f"{args.run}: not a finished `quantnorm evaluate --model` run (results.json and checkpoint/ "
                     "expected); run one first, as the module doc shows")
    results = json.loads((args.run / "results.json").read_text())
    recipe = next((r for r in results["recipes"] if r["name"] == args.recipe), None)
    if recipe is None:
        parser.error(f"{args.run}: no recipe {args.recipe!r} in results.json")
    signed = args.run / recipe["path"]
    fp32 = args.run / "model.fp32.onnx"   # the run's reference: its KL column is against this model
    from transformers import AutoConfig

    checkpoint = args.run / "checkpoint"
    data = prepare_hf_data(load_tokenizer(checkpoint), AutoConfig.from_pretrained(checkpoint), "causal",
                           max_eval_windows=args.windows)
    windows, targets = data.eval_inputs[: args.windows], data.eval_targets[: args.windows]
    print(f"CPU: {cpu_model()}; VNNI: {cpu_has_vnni()}; flags: "
          f"{' '.join(f for f in cpu_flags() if f.startswith(('avx', 'amx')))}; threads {args.threads}")
    reference = list(run_logits(make_session(fp32, SessionSpec(threads=args.threads)), windows, batch_size=1))
    with tempfile.TemporaryDirectory() as tmp:
        unsigned = Path(tmp) / "unsigned.onnx"
        count = unsigned_copy(signed, unsigned)
        if count == 0:   # not per-token with int8 codes (a weight-only recipe: MatMulNBits): the file as written
            rows = [("as written", kl_against(reference, signed, windows, targets, args.threads))]
        else:
            rows = [("signed (u8 x s8)", kl_against(reference, signed, windows, targets, args.threads)),
                    (f"unsigned (u8 x u8, {count} GEMMs)",
                     kl_against(reference, unsigned, windows, targets, args.threads))]
            if args.speed_rounds > 0:
                speeds = interleaved_ms({"signed": signed, "unsigned": unsigned}, windows[:1], args.threads,
                                        args.speed_rounds)
    print(f"{args.recipe}, {len(windows)} windows of {windows.shape[1]} tokens, KL(FP32 || INT8) mean per position:")
    for name, kl in rows:
        print(f"  {name:34s} {kl:.6f}")
    if count and args.speed_rounds > 0:
        print(f"one window of {windows.shape[1]} tokens, batch 1, median of {args.speed_rounds} interleaved rounds: "
              f"signed {speeds['signed']:.2f} ms, unsigned {speeds['unsigned']:.2f} ms, "
              f"unsigned / signed {speeds['unsigned'] / speeds['signed']:.3f}")
    return 0


def interleaved_ms(paths: dict[str, Path], window: np.ndarray, threads: int, rounds: int) -> dict[str, float]:
    """Median ms of one run of ``window`` per model, the models taking turns each round (the files
    as written: no rewrite at load)."""
    sessions = {k: make_session(p, SessionSpec(threads=threads), exact_int8=False) for k, p in paths.items()}
    feed = {next(iter(sessions.values())).get_inputs()[0].name: window}
    for session in sessions.values():   # warm-up: first-run allocations and pre-packing
        session.run(None, feed)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feed)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
