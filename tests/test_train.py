import json
import math

import pytest

from quantnorm.data import DataConfig
from quantnorm.errors import ConfigError
from quantnorm.models import ModelConfig
from quantnorm.runs import open_run_dir
from quantnorm.train import RunConfig, TrainConfig, count_spikes, load_model, train

TINY = ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=32, n_heads=2, context=32)


def tiny_run(steps=30, seed=0, **model):
    cfg = ModelConfig(**{**TINY.to_dict(), **model})
    return RunConfig(cfg, TrainConfig(steps=steps, batch_size=8, lr=3e-3, warmup=5, seed=seed))


def read_log(path):
    return [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]


def test_loss_falls_and_run_dir_is_complete(tmp_path):
    result = train(tiny_run(steps=60), tmp_path / "run", progress=False)
    log = read_log(tmp_path / "run")
    assert len(log) == 60 and not result.diverged
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert first > math.log(257) - 0.5  # starts near uniform over 257 tokens
    assert last < first - 1.0
    assert set(log[0]) >= {"step", "loss", "lr", "grad_norm", "grad_norm_per_layer", "grad_norm_ffn_per_layer"}
    assert set(log[0]["grad_norm_ffn_per_layer"]) == {"block0"} and log[0]["grad_norm_ffn_per_layer"]["block0"] > 0
    assert "grad_norm_ffn_per_layer" not in log[1]   # step 0 only
    assert result.eval_bits_per_byte == pytest.approx(4.77, abs=0.3)   # about the unigram 4.69, not 8
    summary = json.loads((tmp_path / "run" / "train.json").read_text())
    assert summary["unigram_bits_per_byte"] == pytest.approx(4.688, abs=0.01)   # builtin:pydoc
    # 60 steps of a 32-wide model stay on the unigram plateau (about 4.77 bits/byte, where "trained"
    # needs 4.69 - 0.8): the rule classifies it collapsed, and the summary says so
    assert summary["collapse_margin"] == 0.8
    assert summary["eval_bits_per_byte"] == result.eval_bits_per_byte > summary["unigram_bits_per_byte"] - 0.8
    assert summary["status"] == "collapsed"
    run = open_run_dir(tmp_path / "run")
    model, cfg = load_model(run)
    assert cfg.model == tiny_run().model


def test_same_seed_same_curve_other_seed_differs(tmp_path, small_corpus):
    """The training curve is a function of the seed (on the small corpus: the curve is the subject)."""
    def losses(name, seed):
        run = tiny_run(seed=seed)
        train(RunConfig(run.model, run.train, DataConfig(corpus=str(small_corpus))), tmp_path / name, progress=False)
        return [r["loss"] for r in read_log(tmp_path / name)]

    assert losses("a", 1) == losses("b", 1)
    assert losses("a", 1) != losses("c", 2)


def test_divergence_is_a_result(tmp_path):
    run = RunConfig(TINY, TrainConfig(steps=30, batch_size=8, lr=1e30, warmup=0, grad_clip=1e30))
    result = train(run, tmp_path / "run", progress=False)
    assert result.diverged and result.diverged_at is not None and result.eval_bits_per_byte is None
    assert json.loads((tmp_path / "run" / "train.json").read_text())["diverged"] is True
    assert result.status == "diverged"


def test_unigram_baseline_and_status_rule():
    from quantnorm.train_status import classify, status_from_results, unigram_bits_per_byte

    data = bytes([0, 0, 1, 1]) + bytes([0, 1])         # train: half 0, half 1; evaluation: 0 and 1
    assert unigram_bits_per_byte(data, (0, 4), (4, 6)) == pytest.approx(1.0)
    # an evaluation byte unseen in training: add-one smoothing keeps the baseline finite
    assert math.isfinite(unigram_bits_per_byte(bytes([0, 0, 2]), (0, 2), (2, 3)))
    assert classify(3.0, False, 4.688, 0.8) == "trained"
    assert classify(4.05, False, 4.688, 0.8) == "collapsed"     # barely trained counts as collapsed
    assert classify(4.69, False, 4.688, 0.8) == "collapsed"
    assert classify(None, True, 4.688, 0.8) == "diverged"
    # recorded keys are used, the margin can be re-applied
    st = status_from_results({"eval_bits_per_byte": 4.05, "unigram_bits_per_byte": 4.688}, None)
    assert st.status == "collapsed" and not st.derived
    assert status_from_results({"eval_bits_per_byte": 4.05, "unigram_bits_per_byte": 4.688}, None, 0.1).trained


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(0.1) and cfg.lr_at(9) == pytest.approx(1.0)
    assert cfg.lr_at(10) == pytest.approx(1.0) and cfg.lr_at(99) == pytest.approx(0.1, abs=1e-3)
    assert TrainConfig(steps=10, lr=2.0, warmup=0).lr_at(0) == pytest.approx(2.0)


def test_spike_count():
    norms = [1.0] * 40 + [10.0] + [1.0] * 10
    assert count_spikes(norms) == 1
    assert count_spikes([1.0] * 60) == 0


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"steps": -3}, {"warmup": -1}, {"lr": 0.0}, {"batch_size": 0},
                                    {"steps": 10, "warmup": 20}])
def test_bad_train_config(kwargs):
    with pytest.raises(ConfigError):
        TrainConfig(**kwargs)
