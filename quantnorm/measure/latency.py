"""Latency per execution provider: warm-up, p50/p90/p99, throughput, size, peak memory, placement.

Rules this module keeps (``shared/PITFALLS.md`` 3, 4, 6):
- a provider that cannot run here gives a row ``status: "not measured: <reason>"`` with no
  numbers; a CPU timing is never written under a GPU provider's name;
- a QDQ model on the CUDA provider is simulated quantization (ORT's CUDA provider has INT8
  kernels only for QuantizeLinear, DequantizeLinear and MatMulInteger): the row says so;
- which provider ran each node comes from ORT's own profile (``node_providers``), since a
  provider also hands the nodes it cannot run to the CPU without saying so.
No thresholds here: the numbers are reported, the gate judges them.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..data import BOS
from ..errors import MeasureError
from ..feeds import window_feeder
from ..onnx_wire import onnx_nodes
from .sessions import (
    CPU,
    CUDA,
    TENSORRT,
    ProviderUnavailable,
    SessionSpec,
    make_session,
    provider_status,
    short_provider,
)

MEASURED = "measured"
NOT_MEASURED = "not measured: "

# Keys that only a measured row may carry (RESULTS.md: a not-measured row has no timing keys).
_MEASUREMENT_KEYS = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "tokens_per_s", "iterations",
                     "peak_rss_mb", "node_providers", "node_ops", "op_ms", "load_s")

# Op types that make a graph quantized; the first group is the QDQ format (float ops between
# Q/DQ pairs), the second the operator format (quantized kernels: MatMulNBits, the weight-only
# op, has its own CPU and CUDA kernels, so its INT4/INT8 is not simulated on CUDA either).
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
_INTEGER_OPS = {"MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "QLinearConv", "ConvInteger",
                "MatMulIntegerToFloat", "QAttention", "DynamicQuantizeMatMul", "QGemm", "MatMulNBits"}

_SIMULATED_NOTE = ("CUDA EP has INT8 kernels only for QuantizeLinear/DequantizeLinear/MatMulInteger: "
                   "the QDQ graph runs as simulated quantization (float math between Q/DQ)")
_TENSORRT_NOTE = ("TensorRT runs INT8 only where it builds INT8 engines from the Q/DQ nodes: see node_providers; "
                  "ORT's own graph optimizations off (TensorRT optimizes what it takes)")
_TENSORRT_FLOAT_NOTE = "ORT's own graph optimizations off (TensorRT optimizes what it takes)"
_GPU_NOTE = "includes host<->device copies of input_ids and logits"


@dataclass(frozen=True)
class LatencyRow:
    provider: str
    variant: str  # "fp32" or the recipe name
    batch: int
    seq: int
    status: str  # "measured" or "not measured: <reason>"
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    tokens_per_s: float | None = None  # batch * seq / mean seconds per run
    threads: int | None = None  # intra-op threads asked for (None: ORT default)
    iterations: int | None = None  # timed runs (after warm-up)
    size_bytes: int | None = None  # model file on disk
    peak_rss_mb: float | None = None  # process-wide high-water mark after the run, not this model alone
    node_providers: dict | None = None  # nodes per provider, from ORT's profile
    simulated_int8: bool = False
    note: str = ""
    node_ops: dict | None = None  # {provider: {op_type: nodes}}, from the same profile
    # {provider: {op_type: kernel ms}} of one warm profiled run of the first batch (not a timed run;
    # CPU rows only): where the time goes inside ORT, e.g. how much of an INT8 model is still float work
    op_ms: dict | None = None
    # seconds to create the session (read the model; where the provider compiles the graph, e.g.
    # TensorRT's engine build, that too): the first batch's row only
    load_s: float | None = None

    def __post_init__(self) -> None:
        if self.status != MEASURED and not self.status.startswith(NOT_MEASURED):
            raise ValueError(f"status must be {MEASURED!r} or start with {NOT_MEASURED!r}, got {self.status!r}")
        if self.status != MEASURED and any(getattr(self, k) is not None for k in _MEASUREMENT_KEYS):
            raise ValueError("a row that was not measured cannot carry timings")

    @property
    def measured(self) -> bool:
        return self.status == MEASURED

    def to_dict(self) -> dict:
        """A ``latency`` row of results.json; None fields are left out, and a not-measured row
        carries no timing keys."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if not self.note:
            out.pop("note", None)
        if not self.measured:
            for key in _MEASUREMENT_KEYS:
                out.pop(key, None)
        return out


def not_measured(provider: str, variant: str, batch: int, seq: int, reason: str, **extra) -> LatencyRow:
    return LatencyRow(provider=provider, variant=variant, batch=batch, seq=seq, status=NOT_MEASURED + reason, **extra)


# --- model facts ----------------------------------------------------------------------------

def quant_format(path: str | os.PathLike) -> str | None:
    """``"qdq"``, ``"operator"`` (integer kernels such as MatMulInteger) or None for a float model."""
    try:  # op types only: the weights are stepped over, not parsed (1 GB and seconds on Gemma 3)
        ops = {op for op, _, _ in onnx_nodes(path)}
    except (OSError, ValueError, IndexError) as exc:
        raise MeasureError(f"cannot read ONNX model {path}: {' '.join(str(exc).split())[:200]}") from exc
    if ops & _INTEGER_OPS:
        return "operator"
    if ops & _QDQ_OPS:
        return "qdq"
    return None


def random_input_ids(session, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A seeded, valid feed: BOS then random bytes, int64 [batch, seq] (protocol-shaped input)."""
    inp = session.get_inputs()[0]
    if inp.type != "tensor(int64)":
        raise MeasureError(f"model input {inp.name!r} is {inp.type}, expected tensor(int64) token ids")
    vocab = session.get_outputs()[0].shape[-1]
    high = min(vocab, 256) if isinstance(vocab, int) else 256
    ids = np.random.default_rng(seed).integers(0, high, size=(batch, seq), dtype=np.int64)
    if not isinstance(vocab, int) or vocab > BOS:
        ids[:, 0] = BOS
    return window_feeder(session)(ids)


def peak_rss_mb() -> float:
    """The process's peak resident set size so far, in MiB (process-wide, includes every model)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _run(session, feed: dict, path: Path, batch: int, seq: int) -> None:
    try:
        session.run(None, feed)
    except Exception as exc:
        raise MeasureError(f"running {path} on input [{batch}, {seq}] failed: "
                           f"{' '.join(str(exc).split())[:300]} (is seq within the model's context?)") from exc


# --- node placement -------------------------------------------------------------------------

def _placement_from_profile(profile: Path) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Which provider ran each node, read from an ORT profile's ``Node`` events."""
    node_providers, node_ops, _ = _profile_facts(profile)
    return node_providers, node_ops


def read_profile(profile: Path) -> list[dict]:
    """The events of an ORT profile (its JSON file); MeasureError naming the file when unreadable."""
    try:
        return json.loads(profile.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MeasureError(f"cannot read ORT profile {profile}: {exc}") from exc


def profile_runs(events: list[dict]) -> list[dict]:
    """The profile's ``model_run`` events (one per ``session.run``), in time order."""
    return sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e.get("ts", 0))


def _kernel_events(events: list[dict]):
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            yield event


def kernel_events_in(events: list[dict], runs: list[dict]) -> list[dict]:
    """The node kernel events that ran inside ``runs`` (``model_run`` events)."""
    spans = [(r.get("ts", 0), r.get("ts", 0) + r.get("dur", 0)) for r in runs]
    return [e for e in _kernel_events(events) if any(start <= e.get("ts", 0) <= end for start, end in spans)]


def kernel_us_by_op(kernels: list[dict]) -> dict[str, Counter]:
    """Kernel microseconds per provider and op type, summed over ``kernels`` (``kernel_events_in``)."""
    op_us: dict[str, Counter] = {}
    for event in kernels:
        args = event.get("args", {})
        op_us.setdefault(args.get("provider", "unknown"), Counter())[args.get("op_name", "unknown")] += \
            event.get("dur", 0)
    return op_us


def _profile_facts(profile: Path) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, dict[str, float]]]:
    """From an ORT profile: nodes per provider, nodes per provider and op type (every run in
    it), and kernel milliseconds per provider and op type in its last run (``model_run``)."""
    events = read_profile(profile)
    runs = profile_runs(events)
    nodes: dict[str, tuple[str, str]] = {}
    for event in _kernel_events(events):
        args = event.get("args", {})
        # One entry per node even if a subgraph ran it several times.
        nodes[event["name"][: -len("_kernel_time")]] = (args.get("provider", "unknown"), args.get("op_name", "unknown"))
    op_us = kernel_us_by_op(kernel_events_in(events, runs[-1:]))
    per_provider = Counter(provider for provider, _ in nodes.values())
    per_op: dict[str, Counter] = {}
    for provider, op in nodes.values():
        per_op.setdefault(provider, Counter())[op] += 1
    op_ms = {p: {op: round(us / 1e3, 3) for op, us in c.most_common()} for p, c in sorted(op_us.items())}
    return dict(sorted(per_provider.items())), {p: dict(sorted(c.items())) for p, c in sorted(per_op.items())}, op_ms


def _profile_placement(path: str | os.PathLike, spec: SessionSpec, batch: int = 1,
                       seq: int = 1) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Run once with ORT's profiler and read which provider ran each node (``Node`` events)."""
    with tempfile.TemporaryDirectory(prefix="quantnorm-profile-") as tmp:
        session = make_session(path, spec, profile=True, profile_prefix=Path(tmp) / "ort")
        _run(session, random_input_ids(session, batch, seq), Path(path), batch, seq)
        return _placement_from_profile(Path(session.end_profiling()))
        # The temporary directory (and the profile in it) is deleted on exit.


def node_placement(path: str | os.PathLike, spec: SessionSpec, *, batch: int = 1, seq: int = 1) -> dict[str, int]:
    """Nodes per provider (after graph optimization) when the model at ``path`` runs under ``spec``."""
    return _profile_placement(path, spec, batch, seq)[0]


# --- benchmarks -----------------------------------------------------------------------------

# With a time budget, a cell still gets at least this many timed runs (p90 needs a few).
MIN_TIMED_RUNS = 5
# Under a time budget the warm-up stops too, once its runs add up to this share of the budget
# (after MIN_WARMUP_RUNS, the profiled runs included): a large model's warm-up runs, seconds each,
# would otherwise take most of a cell's budget. The first runs pay for allocations and
# pre-packing; two are enough for that.
WARMUP_SHARE = 0.25
MIN_WARMUP_RUNS = 2
# profiled runs of a model's first batch: placement from both, kernel times from the second (warm)
PROFILED_RUNS = 2


def bench_model(path: str | os.PathLike, *, variant: str, spec: SessionSpec, batch: int, seq: int,
                warmup: int = 5, iters: int = 30, is_quantized: bool | None = None, progress: bool = False,
                record_placement: bool = True, seed: int = 0, max_seconds: float | None = None) -> LatencyRow:
    """Time ``iters`` runs (after ``warmup``) of the model at ``path`` on random ids [batch, seq].

    ``max_seconds``: stop timing once the timed runs add up to this much, after at least
    ``MIN_TIMED_RUNS`` of them (the row's ``iterations`` says how many ran; a 3-second Gemma 3
    batch does not need 30 runs for a p50); the warm-up then stops past ``WARMUP_SHARE`` of it
    too, after ``MIN_WARMUP_RUNS`` (the note says so). ``record_placement``: the first run (a warm-up run)
    goes through ORT's profiler, which then stops, and the row records which provider ran each
    node. Returns a ``not measured`` row when the provider cannot run here; raises MeasureError
    when the file is missing or corrupt or the run fails. ``is_quantized`` None: read from the graph.
    """
    return bench_batches(path, variant=variant, spec=spec, batches=[batch], seq=seq, warmup=warmup, iters=iters,
                         is_quantized=is_quantized, progress=progress, record_placement=record_placement, seed=seed,
                         max_seconds=max_seconds)[0]


def bench_batches(path: str | os.PathLike, *, variant: str, spec: SessionSpec, batches: list[int], seq: int,
                  warmup: int = 5, iters: int = 30, is_quantized: bool | None = None, progress: bool = False,
                  record_placement: bool = True, seed: int = 0, max_seconds: float | None = None) -> list[LatencyRow]:
    """``bench_model`` for each batch size in turn, on one session: a model is loaded (and its node
    placement profiled, on the first batch) once, not once per batch size (a large graph's load
    takes seconds). Each batch size gets its own warm-up, timed runs and row."""
    path = Path(path)
    if not batches or min(batches) < 1 or seq < 1 or warmup < 0 or iters < 1:
        raise MeasureError(f"need batch >= 1, seq >= 1, warmup >= 0, iters >= 1; got {batches}, {seq}, {warmup}, {iters}")
    if max_seconds is not None and max_seconds <= 0:
        raise MeasureError(f"the latency time budget must be > 0 seconds, got {max_seconds}")
    if not path.is_file():
        raise MeasureError(f"model file not found: {path}")
    bases = [{"provider": spec.provider, "variant": variant, "batch": batch, "seq": seq,
              "threads": spec.threads, "size_bytes": path.stat().st_size} for batch in batches]
    reason = provider_status(spec.provider)
    if reason is not None:
        return [not_measured(reason=reason, **base) for base in bases]
    rows: list[LatencyRow] = []
    with tempfile.TemporaryDirectory(prefix="quantnorm-profile-") as tmp:
        start = time.perf_counter()
        try:
            session = make_session(path, spec, profile=record_placement, profile_prefix=Path(tmp) / "ort")
        except ProviderUnavailable as exc:
            return [not_measured(reason=str(exc), **base) for base in bases]
        load_s = round(time.perf_counter() - start, 3)
        facts = _Profile()
        if record_placement:
            facts = _profile_first_batch(session, path, spec, batches[0], seq, seed)
        fixed_notes, simulated = _provider_notes(path, spec, is_quantized)
        for i, (batch, base) in enumerate(zip(batches, bases)):
            timing = _Timing(warmup, iters, max_seconds, progress,
                             f"{variant} {short_provider(spec.provider)} b{batch}x{seq}")
            times, notes = timing.run(session, path, batch, seq, seed,
                                      facts.seconds if record_placement and i == 0 else None)
            rows.append(_measured_row(base, times, batch, seq, fixed_notes + notes, simulated,
                                      facts if i == 0 else _Profile(facts.node_providers, facts.node_ops),
                                      load_s if i == 0 else None))
        del session
    return rows


@dataclass
class _Profile:
    """What ORT's profile of the first batch says: nodes per provider and op type, kernel times."""

    node_providers: dict | None = None
    node_ops: dict | None = None
    op_ms: dict | None = None
    seconds: float = 0.0   # the profiled runs' wall time: they count as warm-up


def _profile_first_batch(session, path: Path, spec: SessionSpec, batch: int, seq: int, seed: int) -> _Profile:
    """Two profiled runs of the first batch, never timed (they count as warm-up); the profiler is
    off after them. The placement is read off both, the kernel times off the second: a first run
    also pays for allocations."""
    feed = random_input_ids(session, batch, seq, seed)
    start = time.perf_counter()
    for _ in range(PROFILED_RUNS):
        _run(session, feed, path, batch, seq)
    seconds = time.perf_counter() - start
    node_providers, node_ops, op_ms = _profile_facts(Path(session.end_profiling()))
    if spec.provider != CPU:
        op_ms = None   # a GPU kernel's profile entry times its launch, not its run
    return _Profile(node_providers, node_ops, op_ms, seconds)


def _provider_notes(path: Path, spec: SessionSpec, is_quantized: bool | None) -> tuple[list[str], bool]:
    """The notes every row of this model on this provider carries, and whether its INT8 is simulated."""
    fmt = quant_format(path)
    quantized = (fmt is not None) if is_quantized is None else is_quantized
    notes: list[str] = []
    simulated = spec.provider == CUDA and quantized and fmt != "operator"
    if simulated:
        notes.append(_SIMULATED_NOTE)
    if spec.provider == TENSORRT:
        notes.append(_TENSORRT_NOTE if quantized else _TENSORRT_FLOAT_NOTE)
    if spec.provider != CPU:
        notes.append(_GPU_NOTE)
    return notes, simulated


@dataclass
class _Timing:
    """Warm-up then timed runs of one batch size, each stopped early by the time budget."""

    warmup: int
    iters: int
    max_seconds: float | None
    progress: bool
    label: str

    def run(self, session, path: Path, batch: int, seq: int, seed: int,
            profiled_seconds: float | None) -> tuple[list[float], list[str]]:
        feed = random_input_ids(session, batch, seq, seed)
        notes: list[str] = []
        times: list[float] = []
        with tqdm(total=self.warmup + self.iters, desc=self.label, disable=not self.progress, leave=False,
                  unit="run") as bar:
            warmed = min(self.warmup, PROFILED_RUNS if profiled_seconds is not None else 0)
            warm_seconds = profiled_seconds or 0.0
            bar.update(warmed)
            while warmed < self.warmup:
                if self.max_seconds is not None and warmed >= MIN_WARMUP_RUNS and \
                        warm_seconds >= WARMUP_SHARE * self.max_seconds:
                    notes.append(f"{warmed} of {self.warmup} warm-up runs: stopped at {WARMUP_SHARE:g} of the "
                                 f"time budget")
                    bar.update(self.warmup - warmed)
                    break
                start = time.perf_counter()
                _run(session, feed, path, batch, seq)
                warm_seconds += time.perf_counter() - start
                warmed += 1
                bar.update()
            for _ in range(self.iters):
                start = time.perf_counter()
                _run(session, feed, path, batch, seq)
                times.append(time.perf_counter() - start)
                bar.update()
                if self.max_seconds is not None and len(times) >= MIN_TIMED_RUNS and sum(times) >= self.max_seconds:
                    break
        if len(times) < self.iters:
            notes.append(f"{len(times)} of {self.iters} timed runs: stopped at the {self.max_seconds:g} s time budget")
        return times, notes


def _measured_row(base: dict, times: list[float], batch: int, seq: int, notes: list[str], simulated: bool,
                  facts: _Profile, load_s: float | None) -> LatencyRow:
    times_ms = np.asarray(times, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(times_ms, [50, 90, 99])
    mean_s = float(times_ms.mean()) / 1e3
    return LatencyRow(
        **base, status=MEASURED,
        p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99), mean_ms=mean_s * 1e3,
        tokens_per_s=batch * seq / mean_s, iterations=len(times), peak_rss_mb=round(peak_rss_mb(), 1),
        node_providers=facts.node_providers, node_ops=facts.node_ops, op_ms=facts.op_ms,
        simulated_int8=simulated, note="; ".join(notes), load_s=load_s,
    )


def bench_grid(models: dict[str, Path], providers: list[str], batches: list[int], seq: int, *,
               threads: int | None = None, graph_optimization_level: str = "ORT_ENABLE_ALL",
               warmup: int = 5, iters: int = 30, progress: bool = False,
               record_placement: bool = True, max_seconds: float | None = None) -> list[LatencyRow]:
    """Every (provider, variant, batch) combination; ``models`` maps a variant name ("fp32", a
    recipe name) to its ONNX file. Unusable providers give ``not measured`` rows. ``max_seconds``:
    each cell's time budget (``bench_model``)."""
    rows: list[LatencyRow] = []
    for provider in providers:
        spec = SessionSpec(provider=provider, graph_optimization_level=graph_optimization_level, threads=threads)
        for variant, path in models.items():
            rows += bench_batches(path, variant=variant, spec=spec, batches=list(batches), seq=seq, warmup=warmup,
                                  iters=iters, progress=progress, record_placement=record_placement,
                                  max_seconds=max_seconds)
    return rows


def bench_rounds(models: dict[str, Path], providers: list[str], batches: list[int], seq: int, *, rounds: int,
                 **grid) -> list[LatencyRow]:
    """``bench_grid`` ``rounds`` times over, interleaved (A, B, C, A, B, C, ...), each cell keeping
    the round with the lowest p50; its note lists every round's p50. Why: on a shared machine a
    neighbour's load only ever adds time, and it comes and goes: one INT8 graph can time 40% apart
    from one minute to the next while its FP32 model stays within a few percent. The node placement
    and kernel times are profiled in the first round only."""
    if rounds < 1:
        raise MeasureError(f"need at least one round, got {rounds}")
    placement = grid.pop("record_placement", True)
    per_round = [bench_grid(models, providers, batches, seq, record_placement=placement and r == 0, **grid)
                 for r in range(rounds)]
    if rounds == 1:
        return per_round[0]
    out = []
    for cells in zip(*per_round, strict=True):
        first = cells[0]
        measured = [c for c in cells if c.measured]
        if not measured:
            out.append(first)
            continue
        best = min(measured, key=lambda c: c.p50_ms)
        p50s = ", ".join(f"{c.p50_ms:.1f}" for c in measured)
        note = "; ".join(n for n in (best.note, f"lowest p50 of {len(measured)} interleaved rounds ({p50s} ms)") if n)
        out.append(replace(best, note=note, node_providers=first.node_providers, node_ops=first.node_ops,
                           op_ms=first.op_ms))
    return out
