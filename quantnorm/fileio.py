"""Atomic file writes: write to a temporary file beside the target, then rename into place.

A crash or a kill mid-write leaves either the old file or none, never half a file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx

from .onnx_wire import external_data_locations, without_field, write_model_streaming


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(target: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto the target on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # the PID in the name: the next run can tell a file of a dead process from a live one's
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}-", suffix=suffix + ".tmp",
                                    dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp makes 0600 (and some writers recreate the file): give it normal permissions.
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# What an interrupted run can leave in a run directory: atomic_path's temporary files
# (".<name>.<pid>-<random><suffix>.tmp") and the FP32 outputs cache (".fp32-outputs-<pid>-<random>/").
STALE_PATTERNS = (".*.tmp", ".fp32-outputs-*")
_PID_IN_NAME = re.compile(r"^\.(?:fp32-outputs-|.+\.)(\d+)-")


def temporary_owner_alive(name: str) -> bool | None:
    """Whether the process named in a temporary's name still runs (None: the name holds no PID)."""
    match = _PID_IN_NAME.match(name)
    if match is None:
        return None
    pid = int(match.group(1))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def sweep_stale_temporaries(directory: str | os.PathLike, *, older_than: float) -> list[Path]:
    """Remove what an interrupted run left in ``directory`` (STALE_PATTERNS): a temporary whose
    process is gone, or, for a name without a PID, one made before ``older_than`` (a time.time()
    value). Returns what was removed."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for pattern in STALE_PATTERNS:
        for path in directory.glob(pattern):
            try:
                alive = temporary_owner_alive(path.name)
                if alive or (alive is None and path.lstat().st_mtime >= older_than):
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(target: str | os.PathLike, data: Any) -> None:
    write_text_atomic(target, json.dumps(data, indent=2, sort_keys=False) + "\n")


# ONNX files: protobuf cannot serialize a message over 2 GB, so a graph whose weights pass that
# is written with its tensors in ``<file name>.data`` beside it (ONNX external data; onnxruntime
# and onnx.load read it from the same directory). The threshold leaves room for the graph itself;
# QUANTNORM_EXTERNAL_DATA_BYTES lowers it (the tests do, with small models).
EXTERNAL_DATA_BYTES = 1_800_000_000


def external_data_threshold() -> int:
    value = os.environ.get("QUANTNORM_EXTERNAL_DATA_BYTES")
    return int(value) if value else EXTERNAL_DATA_BYTES


def needs_external_data(n_bytes: int) -> bool:
    return n_bytes > external_data_threshold()


def external_data_file(path: str | os.PathLike) -> Path:
    """Where ``save_onnx`` puts the weights of ``path`` when it needs external data."""
    path = Path(path)
    return path.with_name(path.name + ".data")


def save_onnx(model, path: str | os.PathLike, *, data_name: str | None = None) -> None:
    """Save an ``onnx.ModelProto`` to ``path``: inline, or with external data when its size passes
    the threshold. ``data_name``: the data file's name when ``path`` is a temporary that will be
    renamed (the location is stored relative to the model file, so it must be the final name's)."""
    path = Path(path)
    if needs_external_data(serialized_size_estimate(model)):
        location = data_name or external_data_file(path).name
        (path.parent / location).unlink(missing_ok=True)  # convert_model_to_external_data appends otherwise
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=location, size_threshold=1024)
        os.chmod(path.parent / location, 0o666 & ~_current_umask())
    else:
        write_model_streaming(model, path)


def _element_bytes(data_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, TypeError, ValueError):   # UNDEFINED or a type numpy cannot hold
        return 8


def serialized_size_estimate(model) -> int:
    """About how many bytes ``model`` serializes to, from its weights' shapes: upb's ByteSize()
    serializes the whole model to count it (1.7 GB of memory for a moment on Gemma 3's graph)."""
    total = without_field(model.graph, "initializer").ByteSize()
    for init in model.graph.initializer:
        count = 1
        for dim in init.dims:
            count *= dim
        if init.data_type == onnx.TensorProto.STRING:
            total += sum(len(text) + 8 for text in init.string_data) + 64
        else:
            total += count * _element_bytes(init.data_type) + 64
    return total


def onnx_needs_external_data(path: str | os.PathLike) -> bool:
    """Whether a model file's weights (inline, or in its external data files) pass the threshold:
    copies of it (a preprocessed or augmented model) then need external data too."""
    path = Path(path)
    if needs_external_data(path.stat().st_size):
        return True
    # The locations by a wire walk: onnx.load parses every inline weight (3.5 GB of memory for a
    # moment on Gemma 3's 1.7 GB pre-processed graph) to read a few strings.
    locations = external_data_locations(path)
    return needs_external_data(path.stat().st_size + sum((path.parent / loc).stat().st_size
                                                           for loc in locations if (path.parent / loc).is_file()))


def release_memory(*, collect_cycles: bool = True) -> None:
    """Give freed memory back to the OS after a stage that allocated gigabytes (an export, a
    quantizer pass): glibc keeps freed arenas mapped, so the process' RSS would stay at the high
    water of every earlier stage. ``collect_cycles``: first free what only reference cycles hold
    (torch's exporter graphs, the quantizer's objects); a full collection walks every object of
    the process (0.4 s with torch and transformers loaded), so callers that freed by reference
    count alone (an ORT session, numpy buffers, protobuf messages) pass False. No-op where
    ``malloc_trim`` does not exist."""
    import ctypes  # stdlib; only here, where the C library is asked
    import gc

    if collect_cycles:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_freeze_depth = 0


@contextmanager
def collections_skip_existing_objects() -> Iterator[None]:
    """Inside: the garbage collector's full collections (``release_memory``, 20-odd a run) skip
    every object alive on entry, the imported modules, classes and functions above all (300k with
    torch and transformers; 0.13 s a collection in a fresh process, 0.05 ms with them set aside).
    Garbage is collected first, and on exit the objects are handed back, so one alive on entry that
    becomes garbage during the run is freed after it (``gc.freeze``/``gc.unfreeze``; nested uses
    set aside once)."""
    import gc

    global _freeze_depth
    if _freeze_depth == 0:
        gc.collect()
        gc.freeze()
    _freeze_depth += 1
    try:
        yield
    finally:
        _freeze_depth -= 1
        if _freeze_depth == 0:
            gc.unfreeze()
