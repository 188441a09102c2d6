"""What an INT8 model's weight forms execute on ONNX Runtime's AVX2 kernels: instructions per prompt and per token.

    python benchmarks/avx2_instructions.py --reference runs/vs-smollm2/model.fp32.onnx \\
        runs/vs-smollm2/model.int8.rotated-pertoken-fused-gptq-emb8.past.onnx [more INT8 graphs] [--prompt 128]

A CPU without VNNI runs a per-token model's weights stored unsigned (the u8 x u8 kernel,
``quantnorm.unsigned_weights``), because its u8 x s8 kernel saturates; ONNX Runtime's quantizer
recipes keep the u8 x s8 kernel there with 7-bit weights instead. What the unsigned form costs on
such a CPU cannot be timed on one with AVX-512: ONNX Runtime picks its kernels by cpuid. valgrind
presents its own CPU, AVX2 and FMA without AVX-512 or VNNI, so under it ONNX Runtime runs the
kernels an AVX2-only machine runs, and callgrind counts what they execute. An instruction count
is repeatable (one thread, whatever else the machine does) but it is not time: a ``vpmaddwd`` and
an FMA count alike, memory stalls not at all. Read the ratios between the INT8 forms, not against
another engine's seconds.

Each graph is counted on a prompt and on one new token. A with-past graph (what generation
deploys: ``model.int8.<recipe>.past.onnx``) runs the prompt after an empty cache, with logits at
its last position only where the graph takes ``logits_to_keep`` (as quantnorm's decode loop and
llama.cpp prompt), then one token after the prompt's cache. A whole-window graph runs the prompt
as one window (logits at every position) and a one-token window (a step's GEMMs at M = 1, without
a cache). One process under ``valgrind --tool=callgrind --instr-atstart=no`` loads ONNX Runtime
and each model in turn uninstrumented and runs each feed once to warm up, then is counted over one
more run of it alone (``callgrind_control``: instrumentation on, counters zeroed, one run, a
dump, instrumentation off). Every row's counts are also given as ratios to the first row's. A
file with int8 weight codes past +-64 against uint8 activations is counted as written
(``signed``: u8 x s8) and as the copy a session on a CPU without VNNI runs (``unsigned``: u8 x u8). ``--reference`` names an FP32
graph run once on this machine's own kernels (not counted): each row's KL(FP32 || INT8) per
position over the prompt's logits shows the signed form saturating under valgrind's CPU, and so
that the AVX2 kernels ran. The prompt is pseudo-random token ids (seed 0) below the vocabulary: a
count barely depends on the values, a KL does (it runs above a real text's).

valgrind runs an FMA lane by lane in C: an FP32 graph takes about 1,900 times its native time
under it (SmolLM2-135M: 16 tokens in 2 minutes, uninstrumented), an INT8 one about 200 times (128
tokens in a minute). Count an FP32 graph only on short prompts. Needs valgrind (Debian's
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
session, presents = None, {}
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "load":          # one model at a time: the last one's memory goes first
        session, presents = None, {}
        session = ort.InferenceSession(args[0], options, providers=["CPUExecutionProvider"])
    else:                          # prompt|step FEED.npz LOGITS|-
        feed = dict(np.load(args[0]))
        if command == "step":      # the cache the last prompt left: a step at its depth, as often as asked
            feed.update({name.replace("present", "past_key_values", 1): value for name, value in presents.items()})
        names = [o.name for o in session.get_outputs()]
        outputs = dict(zip(names, session.run(None, feed)))
        if command == "prompt":
            presents = {name: value for name, value in outputs.items() if name.startswith("present.")}
        if args[1] != "-":
            np.save(args[1], outputs[names[0]])
    print("done", flush=True)
"""


@dataclass
class Count:
    label: str
    prompt: int             # instructions of the prompt
    token: int              # instructions of one new token
    logits: np.ndarray      # the prompt's (every position, or the last where the graph keeps only it)


class Counter:
    """One process under ``valgrind --tool=callgrind --instr-atstart=no`` that loads the models in
    turn and runs feeds through them, counted only where asked (``callgrind_control``)."""

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

    def _counted(self, command: str, feed: Path) -> int:
        """One run, after a warm-up run of the same feed."""
        self._send(f"{command} {feed} -")
        self._control("--instr=on")
        self._control("--zero")        # a dump alone does not leave the next one's counts from zero
        self._send(f"{command} {feed} -")
        self._control("--dump")
        self._control("--instr=off")
        return self._dumped_instructions()

    def count(self, model: Path, label: str, feeds: Feeds) -> Count:
        self._send(f"load {model}")
        kept = self.work / "logits.npy"
        self._send(f"prompt {feeds.prompt} {kept}")
        prompt = self._counted("prompt", feeds.prompt)        # and the cache a step reads: the prompt's
        token = self._counted("step" if feeds.with_past else "prompt", feeds.token)
        return Count(label, prompt, token, np.load(kept))

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


@dataclass
class Feeds:
    with_past: bool
    prompt: Path     # .npz: the prompt from an empty cache
    token: Path      # .npz: one new token (with-past: its ids, mask, position; the cache is the prompt's)


def graph_feeds(model: Path, ids: np.ndarray, out: Path) -> Feeds:
    """The prompt and one new token for ``model``'s graph. A whole-window graph: the window, and a
    one-token window (no cache). A with-past graph: the prompt after an empty cache, logits at its
    last position only where the graph takes ``logits_to_keep`` (as a deployment prompts, and as
    llama.cpp does), then one token after it."""
    import onnx

    from quantnorm.feeds import ATTENTION_MASK, LOGITS_TO_KEEP, PAST_INPUT, POSITION_IDS

    try:
        graph = onnx.load(str(model), load_external_data=False).graph
    except Exception as error:   # protobuf's DecodeError and kin: not an ONNX file
        raise ValueError(f"{model}: not an ONNX graph ({type(error).__name__}); pass model.*.onnx files") from None
    inputs = [i for i in graph.input if i.name not in {init.name for init in graph.initializer}]
    optional = {i.name for i in graph.input} - {i.name for i in inputs}    # inputs with a default
    first, prompt_len = inputs[0].name, ids.shape[1]
    with_past = any(PAST_INPUT.match(i.name) for i in graph.input)
    if not with_past:
        if len(inputs) != 1:
            raise ValueError(f"{model}: inputs {', '.join(i.name for i in inputs)}: neither a whole-window graph "
                             "(the token ids alone) nor a with-past one (past_key_values.*)")
        prompt, token = {first: ids}, {first: ids[:, -1:]}
    else:
        prompt, token = {first: ids}, {first: ids[:, -1:]}
        for arg in graph.input:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(arg.type.tensor_type.elem_type)
            if arg.name == ATTENTION_MASK:
                prompt[arg.name] = np.ones((1, prompt_len), dtype)
                token[arg.name] = np.ones((1, prompt_len + 1), dtype)
            elif arg.name == POSITION_IDS:
                prompt[arg.name] = np.arange(prompt_len, dtype=dtype)[None, :]
                token[arg.name] = np.asarray([[prompt_len]], dtype)
            elif arg.name == LOGITS_TO_KEEP:
                prompt[arg.name] = token[arg.name] = np.ones(1, dtype)
            elif PAST_INPUT.match(arg.name):
                dims = arg.type.tensor_type.shape.dim
                prompt[arg.name] = np.zeros((1, dims[1].dim_value, 0, dims[3].dim_value), dtype)
            elif arg.name != first and arg.name not in optional:
                raise ValueError(f"{model}: input {arg.name!r} is not one a with-past graph of quantnorm's takes")
    np.savez(out.with_suffix(".prompt.npz"), **prompt)
    np.savez(out.with_suffix(".token.npz"), **token)
    return Feeds(with_past, out.with_suffix(".prompt.npz"), out.with_suffix(".token.npz"))


def kl_per_position(reference: np.ndarray, other: np.ndarray) -> float:
    """KL(reference || other) per position, over the positions ``other`` has (its last ones)."""
    from quantnorm.measure.accuracy import log_softmax

    p_log, q_log = log_softmax(reference[:, -other.shape[1]:]), log_softmax(other)
    return float((np.exp(p_log) * (p_log - q_log)).sum(axis=-1).mean())


def native_logits(model: Path, ids: np.ndarray) -> np.ndarray:
    """A window through ``model`` on this machine's own kernels, every position's logits."""
    import onnxruntime as ort

    from quantnorm.feeds import window_feeder

    options = ort.SessionOptions()
    options.log_severity_level = 3   # errors only (an overridable logits_to_keep draws a warning)
    try:
        session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    except Exception as error:   # onnxruntime's InvalidProtobuf, Fail, ...
        raise ValueError(f"{model}: ONNX Runtime cannot load it ({str(error).splitlines()[0][:200]})") from None
    return session.run(None, window_feeder(session)(ids))[0]


def count_every_form(counter: Counter, models: list[Path], feeds: list[Feeds], work: Path) -> list[Count]:
    """Each model as written, and one with int8 weight codes at risk of saturating stored unsigned
    too (what a session on a CPU without VNNI runs)."""
    import onnx

    from quantnorm.unsigned_weights import to_unsigned

    counts = []
    for index, (model, model_feeds) in enumerate(zip(models, feeds)):
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
            counts.append(counter.count(path, f"{model.name} | {form}", model_feeds))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+",
                        help="ONNX graphs to count, whole-window (token ids in, logits out) or with-past "
                             "(model.int8.<recipe>.past.onnx); ratios are to the first")
    parser.add_argument("--reference", type=Path,
                        help="an FP32 graph, run on this machine (not counted): each row's KL against it")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    args = parser.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not found: install valgrind (Debian: apt-get install valgrind)")
    for model in [*args.models, *([args.reference] if args.reference else [])]:
        if not model.is_file():
            parser.error(f"{model}: no such ONNX file")
    if args.prompt < 1:
        parser.error(f"--prompt {args.prompt}: at least 1 token")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:   # the vocabulary; then every graph's feeds, before anything is counted
            vocab = native_logits(args.models[0], np.zeros((1, 1), dtype=np.int64)).shape[-1]
            ids = np.random.default_rng(0).integers(0, vocab, size=(1, args.prompt), dtype=np.int64)
            feeds = [graph_feeds(model, ids, work / f"feeds-{index}") for index, model in enumerate(args.models)]
            reference = native_logits(args.reference, ids) if args.reference else None
        except ValueError as error:
            parser.error(str(error))
        counter = Counter(work)
        try:
            counts = count_every_form(counter, args.models, feeds, work)
        finally:
            counter.close()

    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    import onnxruntime as ort

    print(f"Instructions, batch 1, on ONNX Runtime {ort.__version__}'s kernels for the CPU {valgrind} presents "
          "(AVX2 + FMA, no AVX-512, no VNNI), 1 thread: callgrind's count, not seconds. One new token: after the "
          f"prompt's cache in a with-past graph, a one-token window (no cache) in a whole-window one.")
    kl_column = f" | KL vs {args.reference.name} (prompt)" if reference is not None else ""
    header = f"| model | weights | prompt ({args.prompt} tokens) | x first | one new token | x first{kl_column} |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    first = counts[0]
    for counted in counts:
        kl = f" | {kl_per_position(reference, counted.logits):.6f}" if reference is not None else ""
        print(f"| {counted.label} | {counted.prompt / 1e6:,.1f} M | {counted.prompt / first.prompt:.3f} | "
              f"{counted.token / 1e6:,.1f} M | {counted.token / first.token:.3f}{kl} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
