"""What an INT8 model's weight forms execute on ONNX Runtime's AVX2 kernels: instructions per forward.

    python benchmarks/avx2_instructions.py --reference runs/vs-smollm2/model.fp32.onnx \\
        runs/vs-smollm2/model.int8.rotated-pertoken-fused-gptq-emb8.onnx [more INT8 graphs] [--tokens 128,1]

A CPU without VNNI runs a per-token model's weights stored unsigned (the u8 x u8 kernel,
``quantnorm.unsigned_weights``), because its u8 x s8 kernel saturates; ONNX Runtime's quantizer
recipes keep the u8 x s8 kernel there with 7-bit weights instead. What the unsigned form costs on
such a CPU cannot be timed on one with AVX-512: ONNX Runtime picks its kernels by cpuid. valgrind
presents its own CPU, AVX2 and FMA without AVX-512 or VNNI, so under it ONNX Runtime runs the
kernels an AVX2-only machine runs, and callgrind counts what they execute. An instruction count
is repeatable (one thread, whatever else the machine does) but it is not time: a ``vpmaddwd`` and
an FMA count alike, memory stalls not at all. Read the ratios between the INT8 forms, not against
another engine's seconds.

One process under ``valgrind --tool=callgrind --instr-atstart=no`` loads ONNX Runtime and each
model in turn uninstrumented, runs each window once to warm up (its logits kept for the KL column),
then is counted over one more run of it alone (``callgrind_control``: instrumentation on, counters
zeroed, one run, a dump). Every row's count is also given as a ratio to the first row's. A file
with int8 weight codes past +-64 against uint8 activations is counted as written (``signed``: u8 x
s8) and as the copy a session on a CPU without VNNI runs (``unsigned``: u8 x u8). ``--reference``
names an FP32 graph run once on this machine's own kernels (not counted): each row's KL(FP32 ||
INT8) per position of the first window shows the signed form saturating under valgrind's CPU, and
so that the AVX2 kernels ran. The windows are pseudo-random token ids (seed 0) below the
vocabulary: a count barely depends on the values, a KL does (it runs above a real text's).

valgrind runs an FMA lane by lane in C: an FP32 graph takes about 1,900 times its native time
under it (SmolLM2-135M: 16 tokens in 2 minutes, uninstrumented), an INT8 one about 200 times (128
tokens in a minute). Count an FP32 graph only over short windows. Needs valgrind (Debian's
``valgrind``: callgrind and callgrind_control).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The program valgrind runs: numpy and onnxruntime only, so that its uninstrumented start takes
# seconds. One thread, no spinning: a waiting worker would execute instructions of its own.
CHILD = r"""
import sys
import numpy as np
import onnxruntime as ort

options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
options.add_session_config_entry("session.intra_op.allow_spinning", "0")
session = None
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "load":          # one model at a time: the last one's memory goes first
        session = None
        session = ort.InferenceSession(args[0], options, providers=["CPUExecutionProvider"])
    else:                          # run IDS LOGITS|-
        logits = session.run(None, {session.get_inputs()[0].name: np.load(args[0])})[0]
        if args[1] != "-":
            np.save(args[1], logits)
    print("done", flush=True)
"""


@dataclass
class Count:
    label: str
    instructions: dict[int, int]     # tokens -> instructions of one forward
    logits: np.ndarray               # the warm-up window of the first length


class Counter:
    """One process under ``valgrind --tool=callgrind --instr-atstart=no`` that loads the models in
    turn and runs windows through them, counted only where asked (``callgrind_control``)."""

    def __init__(self, work: Path):
        self.work, self.dumped = work, set()
        child = work / "child.py"
        child.write_text(CHILD)
        self.process = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                         f"--callgrind-out-file={work / 'callgrind.out'}", sys.executable, str(child)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self._answer("ready", "did not start")

    def _answer(self, expected: str, what: str) -> None:
        if self.process.stdout.readline().strip() != expected:
            raise RuntimeError(f"the counted program {what}: {self.process.stderr.read()[-2000:]}")

    def _send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        self._answer("done", f"stopped at `{line}`")

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.process.pid)], check=True, capture_output=True,
                       text=True, timeout=300)

    def count(self, model: Path, label: str, windows: dict[int, Path]) -> Count:
        """Instructions of one forward per window length, each counted after a warm-up run of it."""
        self._send(f"load {model}")
        instructions, logits = {}, None
        for tokens, ids in windows.items():
            kept = self.work / "logits.npy"
            self._send(f"run {ids} {kept if logits is None else '-'}")
            if logits is None:
                logits = np.load(kept)
            self._control("--instr=on")
            self._control("--zero")
            self._send(f"run {ids} -")
            self._control("--dump")
            self._control("--instr=off")
            instructions[tokens] = self._dumped_instructions()
        return Count(label, instructions, logits)

    def _dumped_instructions(self) -> int:
        """The instruction total of the one dump callgrind wrote since the last one."""
        files = set(self.work.glob("callgrind.out.*"))   # the numbered dumps; the bare name is the final one
        new = files - self.dumped
        if len(new) != 1:
            raise RuntimeError(f"callgrind wrote {len(new)} dump files where one was expected: {sorted(new)}")
        self.dumped = files
        match = re.search(r"^(?:summary|totals): (\d+)", next(iter(new)).read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{next(iter(new))}: no instruction total")
        return int(match.group(1))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=600)
            except subprocess.TimeoutExpired:
                self.process.kill()


def kl_per_position(reference: np.ndarray, other: np.ndarray) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p_log, q_log = log_softmax(reference), log_softmax(other)
    return float((np.exp(p_log) * (p_log - q_log)).sum(axis=-1).mean())


def native_logits(model: Path, ids: np.ndarray) -> np.ndarray:
    """One window through ``model`` on this machine's own kernels."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise ValueError(f"{model}: {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); a whole-window "
                         "graph with one input (the token ids) is expected, not a with-past graph")
    return session.run(None, {inputs[0].name: ids})[0]


def count_every_form(counter: Counter, models: list[Path], windows: dict[int, Path], work: Path) -> list[Count]:
    """Each model as written, and one with int8 weight codes at risk of saturating stored unsigned
    too (what a session on a CPU without VNNI runs)."""
    import onnx

    from quantnorm.unsigned_weights import to_unsigned

    counts = []
    for index, model in enumerate(models):
        forms = [("as written", model)]
        proto = onnx.load(str(model))
        converted = to_unsigned(proto)
        if converted:
            unsigned = work / f"unsigned-{index}.onnx"
            onnx.save(proto, str(unsigned), save_as_external_data=True, location=unsigned.name + ".data")
            forms = [("signed (u8 x s8)", model), (f"unsigned (u8 x u8, {converted} GEMMs)", unsigned)]
        del proto
        for form, path in forms:
            print(f"counting {model.name}, {form} ...", file=sys.stderr, flush=True)
            counts.append(counter.count(path, f"{model.name} | {form}", windows))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+",
                        help="whole-window ONNX graphs (token ids in, logits out) to count; ratios are to the first")
    parser.add_argument("--reference", type=Path,
                        help="an FP32 whole-window graph, run on this machine (not counted): each row's KL against it")
    parser.add_argument("--tokens", default="128,1",
                        help="window lengths, comma-separated (default 128,1: a prompt, and the M = 1 GEMMs of a "
                             "decode step without its cache)")
    args = parser.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not found: install valgrind (Debian: apt-get install valgrind)")
    for model in [*args.models, *([args.reference] if args.reference else [])]:
        if not model.is_file():
            parser.error(f"{model}: no such ONNX file")
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated whole numbers expected, e.g. 128,1")
    if not lengths or min(lengths) < 1:
        parser.error(f"--tokens {args.tokens!r}: every length must be at least 1")
    try:   # the vocabulary, and a check that the first graph is a whole-window one
        vocab = native_logits(args.models[0], np.zeros((1, 1), dtype=np.int64)).shape[-1]
    except ValueError as error:
        parser.error(str(error))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        windows = {}
        for tokens in lengths:
            windows[tokens] = work / f"ids-{tokens}.npy"
            np.save(windows[tokens], np.random.default_rng(0).integers(0, vocab, size=(1, tokens), dtype=np.int64))
        try:
            reference = native_logits(args.reference, np.load(windows[lengths[0]])) if args.reference else None
        except ValueError as error:
            parser.error(str(error))
        counter = Counter(work)
        try:
            counts = count_every_form(counter, args.models, windows, work)
        finally:
            counter.close()

    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    import onnxruntime as ort

    print(f"Instructions per forward, batch 1, on ONNX Runtime {ort.__version__}'s kernels for the CPU {valgrind} "
          "presents (AVX2 + FMA, no AVX-512, no VNNI), 1 thread: callgrind's count, not seconds.")
    kl_column = f" | KL vs {args.reference.name} ({lengths[0]} tokens)" if reference is not None else ""
    header = "| model | weights | " + " | ".join(f"{t} tokens | x first" for t in lengths) + kl_column + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    first = counts[0]
    for counted in counts:
        cells = [f"{counted.instructions[t] / 1e6:,.1f} M | {counted.instructions[t] / first.instructions[t]:.3f}"
                 for t in lengths]
        kl = f" | {kl_per_position(reference, counted.logits):.6f}" if reference is not None else ""
        print(f"| {counted.label} | {' | '.join(cells)}{kl} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
