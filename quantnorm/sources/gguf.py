"""GGUF files as a model source: find the file (or its numbered parts), record where it came from,
dequantize it once through transformers' GGUF loader, and cache the FP32 weights as a Hugging Face
checkpoint directory that the one ``--model`` pipeline then reads.

Why a cached directory and not a second pipeline: everything after loading (tokenizing the corpus,
export, recipes, probe, report) already works on a checkpoint directory; a GGUF file only differs
in how its weights are stored. transformers' own ``save_pretrained`` refuses a GGUF-loaded model
("quantized with gguf ... not serializable", PITFALLS.md 12), so the weights are written here with
safetensors, tied embeddings once, as transformers itself stores them.

The FP32 baseline *is* the dequantized model: a 4-bit block grid decoded to float32. Results say
so (``model.source.baseline``), with the file's SHA-256, its quantization type and, for a packaged
checkpoint, the package and version (never an absolute path).

Numbered raw byte parts (``*.gguf.part00``, ``.part01`` ...; only the joined bytes are a GGUF):
the later parts are looked up beside the first one, else through the owning package's
``chunk_paths()`` (the Gemma 3 packages install each part in its own sibling package). The join
is written once into a cache file named by its SHA-256 (``QUANTNORM_CACHE``, default
``~/.cache/quantnorm``) and checked against the package's ``EXPECTED_SHA256`` where it has one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError
from ..fileio import atomic_path, write_json_atomic
from ..portable import owning_distribution
from .hf_loader import dtype_kwarg, one_line, quiet_transformers, require_transformers

GGUF_MAGIC = b"GGUF"
PART_RE = re.compile(r"^(?P<stem>.+\.gguf)\.part(?P<index>\d+)$")
SOURCE_FILE = "quantnorm_source.json"  # in the cached checkpoint: which GGUF it was made from
CHECKPOINT_DIR = "checkpoint"          # the cached FP32 checkpoint inside the run directory
_CHUNK = 1 << 20


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file or the first numbered part of one."""
    name = Path(path).name
    return name.endswith(".gguf") or bool(PART_RE.match(name))


@dataclass(frozen=True)
class GGUFProvenance:
    """``results.model.source`` for a GGUF file (RESULTS.md additions)."""

    kind: str
    file: str                      # the file name (the joined name for parts), never a path
    sha256: str                    # of the file, or of the parts' bytes in order
    quant_type: str                # general.file_type as gguf names it (Q4_1, Q4_K_M ...)
    package: str | None            # the installed distribution that ships it, if any
    package_version: str | None
    parts: tuple[str, ...]         # part file names in order (empty for one file)
    baseline: str = "dequantized to float32 by transformers' GGUF loader"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["parts"] = list(self.parts)
        return out


@dataclass(frozen=True)
class GGUFFile:
    path: Path                     # one readable GGUF file (the cache file for joined parts)
    provenance: GGUFProvenance


def resolve_gguf(path: str | Path, *, cache_dir: Path | None = None, progress: bool = False) -> GGUFFile:
    """The GGUF that ``path`` names, joined from its parts if it is ``*.gguf.part00``, with its
    provenance. One-line ``ConfigError`` for a missing file, a missing part, a bad magic number
    or a checksum that does not match the package's."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such file (give a .gguf file or the first part *.gguf.part00)")
    match = PART_RE.match(path.name)
    if match is None:
        _check_magic(path, path)
        sha = sha256_files([path])
        package, version = owning_package(path)
        prov = GGUFProvenance("gguf", path.name, sha, quant_type_of(path), package, version, ())
        return GGUFFile(path, prov)

    parts, module = find_parts(path, match)
    _check_magic(parts[0], path)
    sha = sha256_files(parts, progress=progress)
    expected = getattr(module, "EXPECTED_SHA256", None) if module is not None else None
    if isinstance(expected, str) and expected and expected.lower() != sha:
        raise ConfigError(f"--model {path}: the joined parts have SHA-256 {sha[:16]}..., but the package says "
                          f"{expected[:16]}...: a part is corrupt or from another release (reinstall the packages)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    joined = cache / "gguf" / f"{sha}.gguf"
    if not joined.is_file():
        joined.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(joined, suffix=".gguf") as tmp, open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, _CHUNK)
    package, version = owning_package(path)
    if module is not None:  # the package that lists the parts names the checkpoint
        main = _distribution_of_module(module.__name__)
        if main is not None:
            package, version = main
    prov = GGUFProvenance("gguf", match.group("stem"), sha, quant_type_of(joined), package, version,
                          tuple(p.name for p in parts))
    return GGUFFile(joined, prov)


def find_parts(first: Path, match: re.Match) -> tuple[list[Path], object | None]:
    """All parts of a split GGUF in order: beside the first part, else from its package's
    ``chunk_paths()``. Returns (parts, the package module or None)."""
    stem, width = match.group("stem"), len(match.group("index"))
    if int(match.group("index")) != 0:
        raise ConfigError(f"--model {first}: give the first part ({stem}.part{0:0{width}d}), not a later one")
    beside = sorted(first.parent.glob(f"{glob_escape(stem)}.part*"), key=lambda p: _part_index(p, stem))
    beside = [p for p in beside if _part_index(p, stem) >= 0]
    module = _package_module(first)
    parts = beside
    if len(beside) <= 1 and module is not None and callable(getattr(module, "chunk_paths", None)):
        try:
            parts = [Path(p) for p in module.chunk_paths()]
        except Exception as exc:  # noqa: BLE001 - the package's own lookup; say what it said
            raise ConfigError(f"--model {first}: {module.__name__}.chunk_paths() failed: {exc}") from None
    indices = [_part_index(p, stem) for p in parts]
    if indices != list(range(len(parts))) or len(parts) < 2:
        found = ", ".join(p.name for p in parts) or "none"
        raise ConfigError(f"--model {first}: the parts of {stem} are incomplete (found {found}); install every "
                          f"part package or put {stem}.part00, .part01 ... side by side")
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise ConfigError(f"--model {first}: part {missing[0].name} is missing; reinstall its package")
    return parts, module


def _part_index(path: Path, stem: str) -> int:
    m = PART_RE.match(Path(path).name)
    return int(m.group("index")) if m and m.group("stem") == stem else -1


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _check_magic(first_bytes_of: Path, named: Path) -> None:
    with open(first_bytes_of, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ConfigError(f"--model {named}: not a GGUF file (its first bytes are {head!r}, not {GGUF_MAGIC!r})")


def sha256_files(paths, *, progress: bool = False) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda f=f: f.read(_CHUNK), b""):
                digest.update(block)
    return digest.hexdigest()


def quant_type_of(path: Path) -> str:
    """``general.file_type`` as gguf's ``LlamaFileType`` names it (``MOSTLY_Q4_1`` -> ``Q4_1``)."""
    try:
        from gguf import GGUFReader, LlamaFileType
    except ImportError:
        raise ConfigError("GGUF files need the gguf extra: pip install 'quantnorm[gguf]'") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError/struct errors for corrupt files
        raise ConfigError(f"--model {path.name}: the GGUF header cannot be read ({' '.join(str(exc).split())[:200]})"
                          ) from None
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file_type {value}"


def owning_package(path: Path) -> tuple[str | None, str | None]:
    """The installed distribution that ships ``path`` (name, version), else (None, None)."""
    owner = owning_distribution(path)
    return (owner[0], owner[1]) if owner else (None, None)


def _package_module(path: Path):
    """The package that lists the parts of ``path`` (``chunk_paths()``): the top-level package
    that ships it, or, for a part package such as ``..._part1``, its main package ``...``."""
    name, _ = owning_package(path)
    if name is None:
        return None
    for top in _top_level_modules(name):
        for candidate in dict.fromkeys((top, re.sub(r"_part\d+$", "", top))):
            spec = importlib.util.find_spec(candidate) if candidate.isidentifier() else None
            if spec is None or not spec.submodule_search_locations:
                continue
            try:
                module = importlib.import_module(candidate)
            except Exception:  # noqa: BLE001 - a package that cannot import gives no chunk list
                continue
            if callable(getattr(module, "chunk_paths", None)):
                return module
    return None


def _top_level_modules(dist_name: str) -> list[str]:
    dist = importlib.metadata.distribution(dist_name)
    text = dist.read_text("top_level.txt")
    if text:
        return [t.strip() for t in text.splitlines() if t.strip()]
    return sorted({str(f).split("/")[0] for f in dist.files or () if "/" in str(f) and ".dist-info" not in str(f)})


def _distribution_of_module(module: str) -> tuple[str, str] | None:
    names = importlib.metadata.packages_distributions().get(module, [])
    if not names:
        return None
    return names[0], importlib.metadata.version(names[0])


def default_cache_dir() -> Path:
    return Path(os.environ.get("QUANTNORM_CACHE") or Path.home() / ".cache" / "quantnorm")


def packaged_gguf(module: str, file: str) -> Path:
    """The path of a GGUF shipped inside an installed package, found without importing it (the
    SmolLM2 package imports llama-cpp and llm at import time)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {module} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / file


# ---------------------------------------------------------------------------------------------
# Dequantize once, cache as a checkpoint directory


def gguf_checkpoint(gguf: GGUFFile, run_dir: Path, *, progress: bool = False) -> Path:
    """``run_dir/checkpoint``: config.json, model.safetensors and tokenizer files dequantized from
    ``gguf`` (reused when its recorded SHA-256 matches, so a second run starts in seconds)."""
    out = Path(run_dir) / CHECKPOINT_DIR
    marker = out / SOURCE_FILE
    if marker.is_file():
        try:
            if json.loads(marker.read_text(encoding="utf-8")).get("sha256") == gguf.provenance.sha256:
                return out
        except (OSError, json.JSONDecodeError):
            pass
    transformers = require_transformers()
    import torch
    from safetensors.torch import save_file

    try:
        import accelerate  # noqa: F401 - transformers' GGUF loader needs it; fail with our words
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise ConfigError("GGUF files need the gguf extra: pip install 'quantnorm[gguf]'") from None
    folder, name = str(gguf.path.parent), gguf.path.name
    quiet = quiet_transformers(transformers)
    try:
        with quiet, _gguf_tensor_bar(enabled=progress):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, local_files_only=True, trust_remote_code=False,
                **dtype_kwarg(transformers, torch.float32))
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                                   trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line for the user
        raise ConfigError(f"--model {gguf.provenance.file}: transformers cannot read this GGUF: {one_line(exc)}"
                          ) from None
    config = model.config
    # The loaded model is a plain float32 module; drop the GGUF quantization record so the
    # directory reads as an ordinary checkpoint (PITFALLS.md 12).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.hf_quantizer = None
    config.architectures = [type(model).__name__]  # what a checkpoint directory's config.json names
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state, seen = {}, {}
    for key, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:  # a tied weight (lm_head = embed_tokens): stored once, as transformers does
            continue
        seen[ptr] = key
        state[key] = tensor.detach().contiguous().clone()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    write_json_atomic(tmp / SOURCE_FILE, gguf.provenance.to_dict())
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _gguf_tensor_bar(*, enabled: bool):
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors")
    whatever its progress-bar setting says; ``--quiet`` must silence it too."""
    import functools

    import transformers.modeling_gguf_pytorch_utils as loader

    original = getattr(loader, "tqdm", None)
    if enabled or original is None:
        yield
        return
    loader.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        loader.tqdm = original
