"""The CLI: bad input gives one line on stderr, exit code 2, and writes nothing."""

import pytest

from quantnorm.cli import main

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "4"]


@pytest.mark.parametrize("args, message", [
    (["--placement", "sandwich", "--norm", "rms"], "--placement"),
    (["--placement", "pre", "--norm", "batch"], "--norm"),
    (["--placement", "pre", "--norm", "rms", "--d-model", "30", "--heads", "4"], "not divisible"),
    (["--placement", "pre", "--norm", "rms", "--steps", "0"], "steps must be > 0"),
    (["--placement", "pre", "--norm", "rms", "--corpus", "MISSING"], "corpus not found"),
    (["--placement", "pre", "--norm", "rms", "--corpus", "EMPTY"], "corpus is empty"),
    (["--placement", "pre", "--norm", "rms", "--corpus", "SMALL"], "corpus too small"),
    (["--placement", "pre", "--norm", "rms", "--out", "FILE"], "existing file"),
])
def test_train_bad_input(tmp_path, capsys, args, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").write_bytes(b"")
    (tmp_path / "SMALL").write_bytes(b"hello world")
    (tmp_path / "FILE").write_text("not a directory")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("placement", ["post", "pre", "peri", "deepnorm", "residual"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_train_every_combination(tmp_path, placement, norm, capsys):
    out = tmp_path / "run"
    assert main(["train", "--placement", placement, "--norm", norm, "--steps", "3", *TINY, "--out", str(out),
                 "--quiet"]) == 0
    assert {"config.json", "model.safetensors", "train_log.jsonl", "train.json"} <= {p.name for p in out.iterdir()}
    assert "bits/byte" in capsys.readouterr().out


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out


def test_recipes_lists_every_recipe_with_its_description(capsys):
    from quantnorm.quantize import DEFAULT_RECIPES, MASSIVE_DEFAULT_RECIPES, RECIPES, with_exclusions

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line[2:].split()[0]: line for line in lines[:-1]}
    assert list(by_name) == list(RECIPES)
    for name, line in by_name.items():
        assert line.startswith("*" if name in DEFAULT_RECIPES else "m" if name in MASSIVE_DEFAULT_RECIPES else " ")
        description = line[2:].split(None, 1)[1]
        assert description == RECIPES[name].describe()
    # The description says what sets the recipes apart.
    assert "MinMax ranges" in by_name["static-minmax-matmul"] and "per-channel" in by_name["static-minmax-matmul"]
    assert "one scale per weight" in by_name["static-minmax-matmul-pertensor"]
    assert "99.999th-percentile" in by_name["static-percentile-matmul"]
    assert "default op list" in by_name["static-minmax-all"]
    assert by_name["dynamic"].split(None, 2)[2].startswith("dynamic:")
    assert "SmoothQuant-smoothed model (alpha 0.5)" in by_name["smoothquant"]
    assert "signed symmetric activations" in by_name["static-minmax-matmul-symact"]
    assert "2 node pattern(s) kept in FP32" in with_exclusions(RECIPES["dynamic"], ("head/*", "a")).describe()


def test_starting_the_cli_imports_no_plotting_and_no_statistics():
    """Every `quantnorm` process (a gate in CI, each sweep cell) pays the CLI's imports: matplotlib
    and scipy.stats are imported where a plot is drawn or a statistic computed, not at start."""
    import subprocess
    import sys

    heavy = ("matplotlib", "scipy.stats")
    code = f"import sys, quantnorm.cli; print([m for m in {heavy!r} if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
