"""measure/accuracy.py against a slow hand-written reference, properties, and a real ONNX model."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantnorm.data import BOS, VOCAB_SIZE, evaluation_windows
from quantnorm.errors import MeasureError
from quantnorm.measure.accuracy import compare, log_softmax, perplexity, run_logits, torch_perplexity


class FakeSession:
    """Stands in for an ORT session: logits = table[token] + pos_bias[position] (a bigram-ish toy).

    Records the batch shapes it was run on, so tests can check the batching.
    """

    def __init__(self, seed: int, scale: float = 3.0, vocab: int = VOCAB_SIZE, seq: int = 12):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((vocab, vocab)) * scale).astype(np.float32)
        self.pos_bias = (rng.standard_normal((seq, vocab)) * scale * 0.3).astype(np.float32)
        self.calls: list[tuple[int, ...]] = []

    def get_inputs(self):
        return [SimpleNamespace(name="input_ids")]

    def logits(self, ids: np.ndarray) -> np.ndarray:
        return self.table[ids] + self.pos_bias[None, : ids.shape[1]]

    def run(self, output_names, feed, run_options=None):
        ids = feed["input_ids"]
        assert ids.dtype == np.int64
        self.calls.append(ids.shape)
        return [self.logits(ids)]


def windows(n: int = 7, seq: int = 12, seed: int = 0):
    """Protocol windows over random bytes: inputs start with BOS, targets are the bytes."""
    corpus = np.random.default_rng(seed).integers(0, 256, size=n * seq + 5, dtype=np.uint8)
    return evaluation_windows(corpus, (3, 3 + n * seq), seq)


def reference(sess_p, sess_q, inputs, targets, scored_from):
    """The slow loop: one position at a time, plain Python math (float64)."""
    nll_p = nll_q = 0.0
    klds, agree = [], 0
    for w in range(inputs.shape[0]):
        lp = sess_p.logits(inputs[w : w + 1])[0].astype(np.float64)
        lq = sess_q.logits(inputs[w : w + 1])[0].astype(np.float64)
        for i in range(scored_from, inputs.shape[1]):
            zp = math.log(sum(math.exp(v - lp[i].max()) for v in lp[i])) + lp[i].max()
            zq = math.log(sum(math.exp(v - lq[i].max()) for v in lq[i])) + lq[i].max()
            t = targets[w, i]
            nll_p += zp - lp[i, t]
            nll_q += zq - lq[i, t]
            klds.append(sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in zip(lp[i], lq[i])))
            agree += int(np.argmax(lp[i]) == np.argmax(lq[i]))
    n = len(klds)
    return {"ppl_fp32": math.exp(nll_p / n), "ppl_int8": math.exp(nll_q / n), "kld_mean": sum(klds) / n,
            "kld_max": max(klds), "kld_p99": float(np.percentile(klds, 99)), "top1_agreement": agree / n,
            "n_scored": n, "bits_per_byte_fp32": nll_p / n / math.log(2)}


@pytest.mark.parametrize("scored_from", [0, 5])
def test_compare_matches_slow_reference(scored_from):
    inputs, targets = windows()
    p, q = FakeSession(1), FakeSession(2, scale=2.0)
    got = compare(p, q, inputs, targets, scored_from=scored_from, batch_size=3)
    ref = reference(p, q, inputs, targets, scored_from)
    for key, value in ref.items():
        assert getattr(got, key) == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert got.ppl_ratio == pytest.approx(ref["ppl_int8"] / ref["ppl_fp32"], rel=1e-9)
    ppl = perplexity(p, inputs, targets, scored_from=scored_from, batch_size=4)
    assert ppl.ppl == pytest.approx(ref["ppl_fp32"], rel=1e-9)
    assert ppl.bits_per_byte == pytest.approx(math.log2(ref["ppl_fp32"]), rel=1e-9)
    assert ppl.mean_nll == pytest.approx(math.log(ref["ppl_fp32"]), rel=1e-9)


def test_to_dict_has_the_results_json_keys():
    inputs, targets = windows(n=2)
    d = compare(FakeSession(1), FakeSession(2), inputs, targets).to_dict()
    for key in ("ppl_fp32", "ppl_int8", "ppl_ratio", "kld_mean", "kld_p99", "kld_max", "top1_agreement"):
        assert isinstance(d[key], float), key
    assert d["n_scored"] == 2 * 12


def test_batching_does_not_change_the_result_and_streams():
    inputs, targets = windows(n=7)
    p, q = FakeSession(3), FakeSession(4)
    results = [compare(p, q, inputs, targets, batch_size=b) for b in (1, 3, 7, 100)]
    for r in results[1:]:
        assert r.kld_mean == pytest.approx(results[0].kld_mean, rel=1e-12)
        assert r.ppl_fp32 == pytest.approx(results[0].ppl_fp32, rel=1e-12)
        assert r.top1_agreement == results[0].top1_agreement
    p.calls.clear()
    list(run_logits(p, inputs, batch_size=3))
    assert p.calls == [(3, 12), (3, 12), (1, 12)]


def test_scored_from_is_respected():
    inputs, targets = windows(n=5)
    p, q = FakeSession(5), FakeSession(6)
    full = compare(p, q, inputs, targets, scored_from=0)
    late = compare(p, q, inputs, targets, scored_from=8)
    assert full.n_scored == 5 * 12 and late.n_scored == 5 * 4
    # Changing the logits at unscored positions changes nothing.
    q2 = FakeSession(6)
    q2.pos_bias[:8] += np.random.default_rng(0).standard_normal(q2.pos_bias[:8].shape).astype(np.float32) * 10
    again = compare(p, q2, inputs, targets, scored_from=8)
    assert again == late
    assert compare(p, q2, inputs, targets, scored_from=0) != full
    with pytest.raises(MeasureError, match="scored_from"):
        perplexity(p, inputs, targets, scored_from=12)


def test_bos_is_an_input_never_a_target():
    inputs, targets = windows(n=4)
    assert (inputs[:, 0] == BOS).all() and not (targets == BOS).any()
    # The first byte of each window is predicted from BOS alone: its NLL reads row table[BOS].
    p = FakeSession(7)
    r = perplexity(p, inputs[:, :1], targets[:, :1])
    lp = log_softmax(p.table[BOS] + p.pos_bias[0])
    assert r.mean_nll == pytest.approx(-lp[targets[:, 0]].mean(), rel=1e-9)
    bad = targets.copy()
    bad[1, 3] = BOS
    with pytest.raises(MeasureError, match="BOS"):
        perplexity(p, inputs, bad)
    with pytest.raises(MeasureError, match="BOS"):
        compare(p, p, inputs, bad)


def test_uniform_model_has_ppl_vocab():
    class Uniform(FakeSession):
        def logits(self, ids):
            return np.zeros((*ids.shape, VOCAB_SIZE), dtype=np.float32)

    inputs, targets = windows(n=2)
    r = perplexity(Uniform(0), inputs, targets)
    assert r.ppl == pytest.approx(VOCAB_SIZE, rel=1e-12)
    assert r.bits_per_byte == pytest.approx(math.log2(VOCAB_SIZE), rel=1e-12)


def test_bad_inputs_are_measure_errors():
    inputs, targets = windows(n=2)
    p = FakeSession(0)
    with pytest.raises(MeasureError, match="shape"):
        perplexity(p, inputs, targets[:, :-1])
    with pytest.raises(MeasureError, match="non-empty"):
        perplexity(p, inputs[:0], targets[:0])

    class Broken(FakeSession):
        def logits(self, ids):
            out = super().logits(ids)
            out[0, 0, 0] = np.nan
            return out

    with pytest.raises(MeasureError, match="non-finite"):
        perplexity(Broken(0), inputs, targets)

    class Crashing(FakeSession):
        def run(self, *a, **k):
            raise RuntimeError("boom\nsecond line")

    with pytest.raises(MeasureError, match="boom second line"):
        perplexity(Crashing(0), inputs, targets)


logit_scales = st.floats(min_value=0.0, max_value=50.0, allow_nan=False)


@settings(max_examples=25, deadline=None)
@given(seed_p=st.integers(0, 10_000), seed_q=st.integers(0, 10_000), scale_p=logit_scales, scale_q=logit_scales,
       scored_from=st.integers(0, 11))
def test_kl_is_never_negative(seed_p, seed_q, scale_p, scale_q, scored_from):
    inputs, targets = windows(n=2, seed=seed_p)
    r = compare(FakeSession(seed_p, scale_p), FakeSession(seed_q, scale_q), inputs, targets, scored_from=scored_from)
    assert 0.0 <= r.kld_mean <= r.kld_max
    assert 0.0 <= r.kld_p99 <= r.kld_max
    assert 0.0 <= r.top1_agreement <= 1.0
    assert r.n_scored == 2 * (12 - scored_from)
    assert math.isfinite(r.ppl_ratio) and r.ppl_ratio == pytest.approx(r.ppl_int8 / r.ppl_fp32, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), scale=logit_scales, scored_from=st.integers(0, 11))
def test_identical_models_agree_exactly(seed, scale, scored_from):
    inputs, targets = windows(n=2, seed=seed)
    r = compare(FakeSession(seed, scale), FakeSession(seed, scale), inputs, targets, scored_from=scored_from)
    assert r.kld_mean == 0.0 and r.kld_max == 0.0 and r.kld_p99 == 0.0
    assert r.top1_agreement == 1.0
    assert r.ppl_ratio == 1.0
    assert r.ppl_fp32 == r.ppl_int8


# --- PyTorch and real ONNX models -----------------------------------------------------------

CTX = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer CausalLM, its FP32 ONNX export and a dynamic INT8 copy."""
    import torch
    from onnxruntime.quantization import quantize_dynamic

    from quantnorm.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(n_layers=1, d_model=32, n_heads=2, context=CTX)).eval()
    d = tmp_path_factory.mktemp("acc")
    fp32, int8 = d / "model.fp32.onnx", d / "model.int8.onnx"
    x = torch.randint(0, 256, (2, 8))
    torch.onnx.export(model, (x,), str(fp32), dynamo=True, external_data=False, opset_version=18,
                      input_names=["input_ids"], output_names=["logits"],
                      dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=CTX)}},
                      verbose=False)
    quantize_dynamic(str(fp32), str(int8), op_types_to_quantize=["MatMul"])
    return model, fp32, int8


def test_torch_perplexity_matches_the_numpy_path(tiny):
    import torch

    model = tiny[0]

    class TorchSession(FakeSession):
        def logits(self, ids):
            with torch.no_grad():
                return model(torch.from_numpy(ids)).numpy()

    inputs, targets = windows(n=5, seq=CTX)
    ref = perplexity(TorchSession(0), inputs, targets, scored_from=3, batch_size=2)
    model.train()
    got = torch_perplexity(model, inputs, targets, scored_from=3, batch_size=3)
    assert model.training  # mode restored
    model.eval()
    assert got.n_scored == ref.n_scored == 5 * (CTX - 3)
    assert got.mean_nll == pytest.approx(ref.mean_nll, rel=1e-9)


def test_onnx_fp32_vs_int8(tiny):
    from quantnorm.measure.sessions import SessionSpec, make_session

    model, fp32, int8 = tiny
    spec = SessionSpec(provider="cpu", graph_optimization_level="all", threads=1)
    s32, s8 = make_session(fp32, spec), make_session(int8, spec)
    inputs, targets = windows(n=6, seq=CTX)
    onnx_ppl = perplexity(s32, inputs, targets, batch_size=4)
    # The export matches PyTorch to ~1e-5 in the logits, so perplexity agrees to rounding.
    assert onnx_ppl.mean_nll == pytest.approx(torch_perplexity(model, inputs, targets).mean_nll, rel=1e-5)
    same = compare(s32, s32, inputs, targets)
    assert same.kld_max == 0.0 and same.top1_agreement == 1.0 and same.ppl_ratio == 1.0
    r = compare(s32, s8, inputs, targets, batch_size=4)
    assert r.n_scored == 6 * CTX
    assert r.ppl_fp32 == pytest.approx(onnx_ppl.ppl, rel=1e-12)
    assert r.kld_max > 0.0  # INT8 really differs
    assert 0.0 <= r.kld_p99 <= r.kld_max and 0.0 <= r.kld_mean <= r.kld_max
    assert 0.5 < r.ppl_ratio < 2.0


def test_reopenable_session_scores_the_same_and_lets_go_of_its_weights(tiny):
    """evaluate closes the FP32 session before each quantizer pass: closed, it holds no session;
    used again, it reopens and scores exactly as a plain session does."""
    from quantnorm.measure.sessions import ReopenableSession, SessionSpec, make_session

    _, fp32, int8 = tiny
    spec = SessionSpec(provider="cpu", threads=1)
    lazy, s8 = ReopenableSession(fp32, spec), make_session(int8, spec)
    assert not lazy.is_open and lazy.opened == 0   # nothing loaded until it is read
    inputs, targets = windows(n=4, seq=CTX)
    first = compare(lazy, s8, inputs, targets)
    assert lazy.is_open and lazy.opened == 1
    lazy.close()
    assert not lazy.is_open
    again = compare(lazy, s8, inputs, targets)
    assert lazy.opened == 2
    plain = compare(make_session(fp32, spec), s8, inputs, targets)
    assert first.kld_mean == again.kld_mean == plain.kld_mean and first.ppl_ratio == plain.ppl_ratio
    with pytest.raises(MeasureError, match="not found"):
        ReopenableSession(Path(fp32).with_name("missing.onnx"), spec).get_inputs()


def test_replayed_fp32_outputs_score_the_same_and_open_the_model_once(tiny, tmp_path):
    """evaluate scores every recipe against the FP32 model on the same windows: the first pass
    records its outputs, later passes read them back (the FP32 session is not reopened), scores
    are identical, and discard() deletes the recording."""
    from quantnorm.measure.sessions import ReopenableSession, ReplayedSession, SessionSpec, make_session

    _, fp32, int8 = tiny
    spec = SessionSpec(provider="cpu", threads=1)
    lazy, s8 = ReopenableSession(fp32, spec), make_session(int8, spec)
    replay = ReplayedSession(lazy, tmp_path, keep_free_bytes=0)   # whatever this machine's disk holds
    inputs, targets = windows(n=6, seq=CTX)
    first = compare(replay, s8, inputs, targets, batch_size=4)
    assert (replay.computed, replay.replayed, lazy.opened) == (2, 0, 1)
    lazy.close()   # as before each quantizer pass
    again = compare(replay, s8, inputs, targets, batch_size=4)
    assert (replay.computed, replay.replayed) == (2, 2) and not lazy.is_open and lazy.opened == 1
    plain = compare(make_session(fp32, spec), s8, inputs, targets, batch_size=4)
    assert first.to_dict() == again.to_dict() == plain.to_dict()
    other = compare(replay, s8, inputs[:3], targets[:3], batch_size=4)   # a new feed: computed, not mixed up
    assert replay.computed == 3 and other.n_scored == 3 * CTX and other.to_dict() != first.to_dict()
    # plain copies of the session's inputs: ORT's NodeArgs would keep a closed session's weights alive
    (arg,) = replay.get_inputs()
    assert type(arg).__name__ == "Arg" and arg.name == make_session(fp32, spec).get_inputs()[0].name
    folder = replay.folder
    assert folder.parent == tmp_path and replay.recorded_bytes > 0 and not list(folder.glob("*.tmp"))
    replay.discard()
    assert not folder.exists() and replay.folder is None
    assert compare(replay, s8, inputs, targets, batch_size=4).to_dict() == plain.to_dict()   # plain from now on


@pytest.mark.parametrize("limit", [{"max_bytes": 0}, {"keep_free_bytes": 1 << 62}])
def test_replay_stops_recording_at_its_byte_limit_or_the_disks_free_space(tiny, tmp_path, limit):
    from quantnorm.measure.sessions import ReplayedSession, SessionSpec, make_session

    _, fp32, int8 = tiny
    spec = SessionSpec(provider="cpu", threads=1)
    replay = ReplayedSession(make_session(fp32, spec), tmp_path, **limit)
    inputs, targets = windows(n=4, seq=CTX)
    for _ in range(2):
        compare(replay, make_session(int8, spec), inputs, targets)
    assert (replay.computed, replay.replayed, replay.recorded_bytes) == (2, 0, 0)
    assert not list(replay.folder.iterdir())


@pytest.mark.parametrize("rows, vocab, scale", [(1, 5, 1.0), (37, 300, 4.0), (40, 4096, 30.0)])
def test_pair_stats_in_row_blocks_equal_the_whole_array_formulas(rows, vocab, scale):
    """The row-block math (several blocks when rows > ROWS_PER_BLOCK) against log_softmax written out."""
    from quantnorm.measure.accuracy import ROWS_PER_BLOCK, log_softmax, nll_rows, pair_stats, target_nll

    rng = np.random.default_rng(rows)
    lp = (scale * rng.standard_normal((rows, vocab))).astype(np.float32)
    lq = (lp + 0.3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    tgt = rng.integers(0, vocab, rows)
    logp, logq = log_softmax(lp), log_softmax(lq)
    nll_p, nll_q, kl, agree = pair_stats(lp, lq, tgt)
    assert rows <= ROWS_PER_BLOCK or rows > 2 * ROWS_PER_BLOCK   # one block and several (a partial last)
    np.testing.assert_allclose(nll_p, target_nll(logp, tgt), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(nll_q, target_nll(logq, tgt), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kl, np.maximum((np.exp(logp) * (logp - logq)).sum(-1), 0), rtol=1e-9, atol=1e-14)
    assert (agree == (lp.argmax(-1) == lq.argmax(-1))).all()
    np.testing.assert_allclose(nll_rows(lp, tgt), target_nll(logp, tgt), rtol=1e-12, atol=1e-12)
    same = pair_stats(lp, lp, tgt)[2]
    assert (same >= 0).all() and same.max() < 1e-12
