"""Suite-wide rules.

Strict skips (``QUANTNORM_STRICT_SKIPS=1``, set by ``.ci/run``): a test may skip only because a
GPU is present or absent (its reason names ``GPU`` or ``CUDA``); any other skip (a missing
package, a missing model pack, an xfail) fails the session. Otherwise CI could go green without
running the Hugging Face or Ray tests at all.
"""

import gc
import os
import re

import pytest

# Under pytest-xdist (.ci/run: a worker per core), torch computes on one thread in each worker:
# two workers' thread pools each as wide as the machine would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

# torch.onnx's dynamo exporter rebuilds its table of ATen -> ONNX functions on every export (half a
# second, of the ~4 s a tiny model's export takes; the suite exports ~140 models). The table
# depends only on the opset, so each process builds it once and every export gets its own copy
# (an export may register custom functions into the one it is handed).
try:
    from torch.onnx._internal.exporter import _registration

    _build_registry = _registration.ONNXRegistry.from_torchlib.__func__
    _registries: dict = {}

    def _registry_copy(cls, opset_version=_registration._constants.TORCHLIB_OPSET):
        if opset_version not in _registries:
            _registries[opset_version] = _build_registry(cls, opset_version)
        registry = cls()
        registry._opset_version = opset_version
        registry.functions = {k: list(v) for k, v in _registries[opset_version].functions.items()}
        return registry

    _registration.ONNXRegistry.from_torchlib = classmethod(_registry_copy)
except (ImportError, AttributeError):   # another torch: its exporter as it comes
    pass

# A full garbage collection walks every object the process holds, and a test worker holds torch,
# transformers, onnx and every test file's imports: 0.4-1 s a collection, which the package pays
# after each heavy stage (fileio.release_memory, per calibration chunk among them). The CLI sets
# aside what is alive when a run starts (fileio.collections_skip_existing_objects); a test that
# calls a stage directly has no such run around it, so the suite does the same at each test file's
# first test, and again after an in-process run has handed its objects back (gc.unfreeze empties
# the frozen generation). What is set aside then (imports, session fixtures) lives as long as the
# worker. Suite set-up, like the torch settings above: tests/test_conftest.py's inner sessions
# take only the rules below.
_frozen_for: list = [None]   # the test module whose first test last set the objects aside


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.module is not _frozen_for[0] or gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
        _frozen_for[0] = item.module


# pytester: tests/test_conftest.py runs small inner sessions; export_cache: repeated exports served
# from a cache (tests/export_cache.py)
pytest_plugins = ["pytester", "export_cache"]

STRICT_SKIPS_ENV = "QUANTNORM_STRICT_SKIPS"
ALLOWED_SKIP = re.compile(r"\b(GPU|CUDA)\b")

_refused: list[tuple[str, str]] = []


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    return reason.removeprefix("Skipped: ")


def _check(report) -> None:
    if report.skipped and os.environ.get(STRICT_SKIPS_ENV) == "1":
        reason = _reason(report)
        if hasattr(report, "wasxfail") or not ALLOWED_SKIP.search(reason):
            _refused.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _check(report)


def pytest_collectreport(report):  # a module-level importorskip skips the whole file at collection
    _check(report)


def pytest_terminal_summary(terminalreporter):
    if _refused:
        terminalreporter.section("skips refused (only GPU presence/absence may skip a test)", red=True)
        for nodeid, reason in _refused:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _refused and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The files that take longest (seconds of test time, 2 workers on 2 cores, 2026-12-06:
# test_generation_stage 167, test_hf 145, test_generation 92, test_sweep 89, test_gguf 87, test_engines
# 69, test_benchmarks 65, test_quantize 55), longest first. Under `-n auto --dist loadfile --no-loadscope-reorder` (.ci/run) a worker runs whole
# files dealt in this order, so a long file dealt late keeps one worker busy while the other has
# nothing left: dealt first, the short files even out the end. A stale list costs only that balance.
HEAVY_FILES = ("test_generation_stage.py", "test_hf.py", "test_generation.py", "test_sweep.py", "test_gguf.py",
               "test_engines.py", "test_benchmarks.py", "test_quantize.py")


def pytest_collection_modifyitems(items):
    """The heavy files first, in HEAVY_FILES' order; every other file, and the tests inside each
    file, stay in pytest-randomly's shuffled order (its hook runs before this one; the sort is
    stable), so a seed still reproduces the whole order."""
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# --- tiny Hugging Face checkpoints, built and exported once per session ------------------------
# Several files detect, export and measure the same tiny checkpoints (tests/test_hf.py's table).
# Each is saved once and exported once, on first use, whatever order the tests run in; the tests
# only read them (a test that changes a checkpoint or a graph works on its own copy).

@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """model_type -> directory of a tiny random checkpoint of tests/test_hf.py's ARCHS (read only)."""
    from test_hf import ARCHS, save_tiny

    root = tmp_path_factory.mktemp("hf-tiny")
    return {name: save_tiny(name, root / name) for name in ARCHS}


@pytest.fixture(scope="session")
def hf_exported(hf_tiny, tmp_path_factory):
    """A function: model_type -> (ONNX path, ModuleExportResult, parity ids) of that checkpoint
    exported with the default exporter and opset, its outputs those the loader names (read only)."""
    import numpy as np

    from quantnorm.sources.hf_export import export_hf_onnx, make_wrapper, output_names
    from quantnorm.sources.hf_loader import load_checkpoint

    root = tmp_path_factory.mktemp("hf-onnx")
    done = {}

    def exported(name: str):
        if name not in done:
            from test_hf import VOCAB

            loaded = load_checkpoint(hf_tiny[name])
            ids = np.random.default_rng(0).integers(3, VOCAB, size=(2, 12)).astype(np.int64)
            ids[:, 0] = 1
            path = root / f"{name}.onnx"
            result = export_hf_onnx(make_wrapper(loaded), path, ids, max_positions=128,
                                    outputs=output_names(loaded.spec.kind, loaded.files.mlm_head))
            done[name] = (path, result, ids)
        return done[name]

    return exported


# --- a small corpus ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A 40 kB slice of the builtin corpus (pydoc's topics) as a file, for the runs whose subject is
    not how well a model learns: scoring a tiny run on the whole builtin corpus's evaluation range
    is most of its time. The tests of training quality keep the builtin corpus."""
    import pydoc_data.topics

    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_bytes("".join(pydoc_data.topics.topics.values()).encode("utf-8")[:40_000])
    return path


# --- tiny zoo models, built and exported once per session --------------------------------------
# The zoo's five placements at two layers: read from the graph (test_placement_graph.py), probed in
# the graph against the torch hooks, and the pre one written as an ONNX export directory
# (test_onnx_source.py). The norm alternates over the placements, so each of those tests sees both
# norms (a LayerNormalization node and the decomposed RMSNorm of opset 18).
ZOO_NORMS = {"pre": "rms", "post": "layer", "peri": "rms", "deepnorm": "layer", "residual": "rms"}


@pytest.fixture(scope="session")
def zoo_exported(tmp_path_factory):
    """A function: placement -> (model, ONNX path): a random-init zoo model of that placement
    (norm ``ZOO_NORMS[placement]``, 2 layers, d_model 32, context 32) exported at opset 18 on first
    use (read only: a test that changes either works on its own copy)."""
    import numpy as np
    import torch

    from quantnorm.export import export_onnx
    from quantnorm.models import CausalLM, ModelConfig

    root = tmp_path_factory.mktemp("zoo-onnx")
    done = {}

    def exported(placement: str):
        if placement not in done:
            torch.manual_seed(0)
            model = CausalLM(ModelConfig(placement=placement, norm=ZOO_NORMS[placement], n_layers=2, d_model=32,
                                         n_heads=2, context=32)).eval()
            path = root / f"{placement}.onnx"
            export_onnx(model, path, np.random.default_rng(0).integers(0, 256, size=(2, 32)), opset=18)
            done[placement] = (model, path)
        return done[placement]

    return exported
