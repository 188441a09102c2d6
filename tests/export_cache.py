"""The suite's cache of dynamo exports (tests only; the package never caches an export).

A dynamo export of a tiny model takes ~4 s, and the suite exports ~150 of them; about a fifth (a
third of their time) repeat an export made earlier in the same run (the same tiny checkpoint, the same trained zoo model,
in several files or tests). ``torch.onnx.export(dynamo=True)`` is wrapped so that a call whose
inputs were all seen before copies the file that call wrote instead of exporting again. Everything
after the exporter (the graph passes, the parity gate against the live model, quantization) runs
as it would.

What makes two calls the same (``export_key``): the model's class and code, every submodule's
attributes (configs, flags, plain tensors), every parameter and buffer (persistent or not), the
example inputs, and every keyword but the output path. What turns the cache off:
- a live monkeypatch (``pytest.MonkeyPatch``, the fixture or ``MonkeyPatch.context``), which may
  change code the model's forward calls without changing the model, unless the test declared it
  ``outside_the_export`` (it patches only what runs after the exporter);
- ``QUANTNORM_EXPORT_CACHE=0``; with ``=verify`` every hit also exports afresh and fails the test
  if the two files differ.
- an attribute the key cannot read (an object shown by its address): such a model is never cached.
The cache is a folder in this run's pytest temporary root, shared by the xdist workers and gone
with the run's temporary files; files are written under a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import weakref
from pathlib import Path

import pytest

ENV = "QUANTNORM_EXPORT_CACHE"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

_folder: Path | None = None
_worker_root: str | None = None   # this process's pytest temporary root, keyed as "<tmp>"
_patches: weakref.WeakSet = weakref.WeakSet()
_outside: weakref.WeakSet = weakref.WeakSet()   # patches declared to touch nothing an export runs
stats = {"hits": 0, "misses": 0, "bypassed": 0}


class Unkeyable(Exception):
    """The model holds something the key cannot describe by value."""


def _track_monkeypatches() -> None:
    """Every MonkeyPatch made from here on is remembered (weakly) so a live one can be seen."""
    init = pytest.MonkeyPatch.__init__
    if getattr(init, "_tracked", False):
        return

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _patches.add(self)

    tracked._tracked = True
    pytest.MonkeyPatch.__init__ = tracked


def _a_patch_is_live() -> bool:
    return any(p._setattr or p._setitem or p._cwd is not None or p._savesyspath is not None
               for p in list(_patches) if p not in _outside)


def outside_the_export(patch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Declare that what ``patch`` changes (now and later) is never run by an exported model's
    forward nor by the exporter: a graph pass applied after the export, a quantizer step, a
    session. Exports made while it is live are then served and kept as usual. A patch of anything
    the forward calls (a model's helper function, a torch or transformers function, an environment
    variable) must not be declared: the key cannot see it."""
    _outside.add(patch)
    return patch


def _feed(h, value, depth: int = 0, seen: dict | None = None) -> None:
    """Hash ``value`` by what it holds, never by its address (a value met again on the way down is
    hashed as a reference to its first place)."""
    import numpy as np
    import torch

    if depth > 24:
        raise Unkeyable("too deep")
    seen = {} if seen is None else seen
    if isinstance(value, (list, tuple, dict, set, frozenset)) or hasattr(value, "__code__") or hasattr(value, "__dict__"):
        if id(value) in seen:
            h.update(f"seen {seen[id(value)]}".encode())
            return
        seen[id(value)] = len(seen)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"A{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, str):
        h.update(f"str:{_without_worker_root(value)!r}".encode())
    elif isinstance(value, (bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)):
        h.update(f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}[{len(value)}".encode())
        for item in value:
            _feed(h, item, depth + 1, seen)
    elif isinstance(value, dict):
        h.update(f"dict{{{len(value)}".encode())
        for k in sorted(value, key=repr):
            _feed(h, k, depth + 1, seen)
            _feed(h, value[k], depth + 1, seen)
    elif isinstance(value, (set, frozenset)):
        _feed(h, sorted(value, key=repr), depth + 1, seen)
    elif isinstance(value, type):
        h.update(f"type:{value.__module__}.{value.__qualname__}".encode())
    elif hasattr(value, "__code__"):   # a function or lambda: its code and the values it closes over
        code = value.__code__
        h.update(f"fn:{getattr(value, '__qualname__', '')}".encode())
        h.update(code.co_code)
        _feed(h, [c for c in code.co_consts if not hasattr(c, "co_code")], depth + 1, seen)
        _feed(h, _closed_over(value), depth + 1, seen)
    elif hasattr(value, "__func__"):   # a bound method
        _feed(h, value.__func__, depth + 1, seen)
    elif hasattr(value, "gi_code"):    # a generator (a context manager used as a decorator holds one)
        h.update(f"gen:{value.gi_code.co_qualname}".encode())
        h.update(value.gi_code.co_code)
    elif _ADDRESS.search(repr(value)) and hasattr(value, "__dict__"):   # a plain object: its class and attributes
        h.update(f"obj:{type(value).__module__}.{type(value).__qualname__}".encode())
        _feed(h, vars(value), depth + 1, seen)
    else:
        text = repr(value)
        if _ADDRESS.search(text):
            raise Unkeyable(f"{type(value).__qualname__} is shown by its address")
        h.update(f"{type(value).__module__}.{type(value).__qualname__}:{_without_worker_root(text)}".encode())


def _without_worker_root(text: str) -> str:
    """A path inside this worker's temporary root, keyed relative to it: each xdist worker saves the
    session's tiny checkpoints under its own root, and a loaded config remembers where it was read
    from (``_name_or_path``), which no exported graph depends on. Without this, the same checkpoint
    exported by the two workers would never share a file."""
    return text.replace(_worker_root, "<tmp>") if _worker_root else text


def _closed_over(fn) -> list:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:   # a cell not yet assigned
            pass
    return values


def export_key(model, args, kwargs) -> str:
    """What decides the exported file: the model's code and state, the inputs, the options."""
    import torch

    h = hashlib.sha256(f"torch {torch.__version__}".encode())
    for name, module in model.named_modules():
        cls = type(module)
        h.update(f"module {name} {cls.__module__}.{cls.__qualname__}".encode())
        for klass in cls.__mro__:   # the code every method of the class runs (a forward's helpers included)
            if klass.__module__.startswith(("torch.nn", "builtins")):
                break
            _feed(h, {k: v for k, v in vars(klass).items() if hasattr(v, "__code__") or hasattr(v, "__func__")})
        _feed(h, {k: v for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules")})
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        _feed(h, tensor)
    _feed(h, args)
    _feed(h, {k: v for k, v in kwargs.items() if k != "f"})
    return h.hexdigest()[:32]


def install(folder: Path, worker_root: Path | None = None) -> None:
    """Wrap ``torch.onnx.export`` (once per process) to serve repeats from ``folder``; a path under
    ``worker_root`` is keyed relative to it."""
    global _folder, _worker_root
    import torch

    _folder = Path(folder)
    _worker_root = str(worker_root) if worker_root else None
    _folder.mkdir(parents=True, exist_ok=True)
    _track_monkeypatches()
    export = torch.onnx.export
    if getattr(export, "_cached", False):
        return

    def cached_export(model, args=(), f=None, **kwargs):
        mode = os.environ.get(ENV, "1")
        if (mode == "0" or _folder is None or not kwargs.get("dynamo") or kwargs.get("external_data")
                or not isinstance(f, (str, os.PathLike)) or _a_patch_is_live()):
            stats["bypassed"] += 1
            return export(model, args, f, **kwargs)
        try:
            key = export_key(model, args, kwargs)
        except Unkeyable:
            stats["bypassed"] += 1
            return export(model, args, f, **kwargs)
        stored = _folder / f"{key}.onnx"
        if stored.is_file():
            stats["hits"] += 1
            if mode == "verify":
                export(model, args, f, **kwargs)
                if Path(f).read_bytes() != stored.read_bytes():
                    raise AssertionError(f"export cache: a fresh export differs from the cached one ({key})")
                return None
            shutil.copyfile(stored, f)
            return None
        stats["misses"] += 1
        program = export(model, args, f, **kwargs)
        tmp = stored.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(f, tmp)
        os.replace(tmp, stored)
        return program

    cached_export._cached = True
    torch.onnx.export = cached_export


# --- the plugin (tests/conftest.py names it in pytest_plugins) -----------------------------------

MODES = ("0", "1", "verify")


def pytest_configure(config):
    mode = os.environ.get(ENV, "1")
    if mode not in MODES:
        raise pytest.UsageError(f"{ENV}={mode!r} is not a setting: use 0 (off), 1 (on, the default) or verify "
                                "(export afresh on every hit and compare)")

def _run_root(config) -> Path:
    """This run's temporary root, shared by the xdist workers (each has a folder of its own in it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _export_cache(request):
    folder = _run_root(request.config) / "export-cache"
    install(folder, request.config._tmp_path_factory.getbasetemp())
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"stats-{worker}.json").write_text(json.dumps(stats))


def pytest_terminal_summary(terminalreporter):
    counts = dict.fromkeys(stats, 0)
    for path in _run_root(terminalreporter.config).glob("export-cache/stats-*.json"):
        for key, value in json.loads(path.read_text()).items():
            counts[key] += value
    if any(counts.values()):
        terminalreporter.write_line(f"export cache (tests/export_cache.py): {counts['hits']} exports served from the "
                                    f"cache, {counts['misses']} made and kept, {counts['bypassed']} made uncached")
