import hashlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from quantnorm.data import (
    BOS,
    BUILTIN_PYDOC,
    VOCAB_SIZE,
    DataConfig,
    evaluation_windows,
    load_corpus,
    make_splits,
    prepare_data,
    window_starts,
    windows_at,
)
from quantnorm.errors import DataError


def test_builtin_corpus_is_pydoc_text():
    import pydoc_data.topics

    corpus = load_corpus(None)
    assert corpus.source == BUILTIN_PYDOC
    assert corpus.data == "".join(pydoc_data.topics.topics.values()).encode("utf-8")
    assert corpus.sha256 == hashlib.sha256(corpus.data).hexdigest()
    assert VOCAB_SIZE == 257 and BOS == 256


def test_directory_corpus_joins_sorted_files(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    assert load_corpus(tmp_path).data == b"first\nsecond"


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing.txt", "not found"),
    (lambda p: (p / "empty.txt").write_bytes(b"") or p / "empty.txt", "empty"),
    (lambda p: (p / "d").mkdir() or p / "d", "empty"),
])
def test_bad_corpus(tmp_path, setup, message):
    with pytest.raises(DataError, match=message):
        load_corpus(setup(tmp_path))


def test_too_small_corpus():
    with pytest.raises(DataError, match="too small"):
        make_splits(1000, window=128)


@settings(max_examples=80, deadline=None)
@given(windows=st.integers(1, 40), extra=st.floats(0, 0.999), window=st.integers(8, 256))
@example(windows=10, extra=0.0, window=128).via("the smallest corpus that splits")
@example(windows=9, extra=0.999, window=128).via("just too small")
def test_splits_are_disjoint_and_cover(windows, extra, window):
    """With the default 10%/10% calibration/evaluation fractions a corpus of 10 windows or more
    splits (each range holds a window, train at least two) and a smaller one is refused. The size
    is drawn in windows so that the boundary is hit, not only corpora far from it."""
    n = int((windows + extra) * window)
    if n < 10 * window:
        with pytest.raises(DataError, match="too small"):
            make_splits(n, window)
        return
    s = make_splits(n, window)
    assert s.train[0] == 0 and s.train[1] == s.calibration[0]
    assert s.calibration[1] == s.evaluation[0] and s.evaluation[1] == n
    assert all(size >= window for size in s.sizes().values())


def test_window_protocol():
    data = np.arange(100, dtype=np.uint8)
    starts = window_starts((10, 45), 8)
    assert starts.tolist() == [10, 18, 26, 34]  # 42 + 8 > 45: last partial window dropped
    inputs, targets = windows_at(data, starts, 8)
    assert inputs[:, 0].tolist() == [BOS] * 4
    assert targets[0].tolist() == list(range(10, 18))
    assert inputs[0, 1:].tolist() == list(range(10, 17))
    # every byte of the covered range is a target exactly once
    assert sorted(targets.ravel().tolist()) == list(range(10, 42))


def test_prepare_data_describes_ranges():
    data = prepare_data(DataConfig(), window=128)
    d = data.describe()
    assert d["corpus"] == BUILTIN_PYDOC and d["bos"] is True and d["window"] == 128
    assert d["train"][1] == d["calibration"][0] and d["calibration"][1] == d["evaluation"][0]
    inputs, targets = evaluation_windows(data.tokens, data.splits.evaluation, 128)
    assert inputs.shape == targets.shape and inputs.shape[1] == 128
