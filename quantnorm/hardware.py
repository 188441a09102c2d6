"""What the measurements ran on: CPU model and ISA flags, library versions, providers, GPU.

Every latency and accuracy number in ``results.json`` depends on this (pitfall 2: the same INT8
model loses accuracy under ORT_ENABLE_ALL on an AVX2 CPU without VNNI), so the run records it in
the ``hardware`` section (see ``shared/RESULTS.md``). That section is assembled by
``quantnorm.measure.sessions.hardware_info``: it also says which providers really load, which
takes an ONNX Runtime session, and the sessions depend on this module, not the reverse.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# ISA flags that decide which INT8/FP32 kernels ONNX Runtime (MLAS) and PyTorch pick. Everything
# else in /proc/cpuinfo (fpu, vme, tsc, ...) is noise for this report.
_RELEVANT_FLAG = re.compile(r"^(sse4_2|avx|avx2|fma|f16c|avx512.*|avx_vnni.*|amx.*)$")
# Instructions that make u8s8 INT8 dot products exact (no saturation, pitfall 2): AVX512-VNNI,
# AVX-VNNI (the 256-bit variant on hybrid/later Intel and Zen 5) and AMX (Sapphire Rapids+).
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "amx_bf16")


def _cpuinfo_field(name: str) -> str | None:
    """The first value of ``name`` in /proc/cpuinfo, or None (not Linux, unreadable, absent)."""
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.lru_cache(maxsize=1)
def _all_cpu_flags() -> tuple[str, ...]:
    # x86 Linux calls them "flags"; ARM Linux calls them "Features".
    raw = _cpuinfo_field("flags") or _cpuinfo_field("Features") or ""
    return tuple(sorted(set(raw.split())))


def cpu_flags() -> list[str]:
    """The ISA flags that matter for ONNX Runtime kernels (SSE4.2, AVX*, FMA, F16C, AVX-512*, VNNI, AMX)."""
    return [flag for flag in _all_cpu_flags() if _RELEVANT_FLAG.match(flag)]


def cpu_has_vnni() -> bool:
    """True when the CPU has AVX512-VNNI, AVX-VNNI or AMX; False when it has none or flags are unknown."""
    flags = set(_all_cpu_flags())
    return any(flag in flags for flag in _VNNI_FLAGS)


def cpu_model() -> str:
    """The CPU model name (``model name`` in /proc/cpuinfo), else what ``platform`` knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_id() -> str | None:
    """Vendor, family, model and stepping from /proc/cpuinfo ("AuthenticAMD family 26 model 2
    stepping 0"), or None where it lists no family and model (not x86 Linux).

    A cloud's model name alone ("AMD EPYC") does not tell two CPU generations apart, and INT8 and
    decode speeds differ between them."""
    vendor, family, model, stepping = (_cpuinfo_field(k) for k in ("vendor_id", "cpu family", "model", "stepping"))
    if family is None or model is None:
        return None
    return " ".join(part for part in (vendor, f"family {family}", f"model {model}",
                                      f"stepping {stepping}" if stepping is not None else None) if part)


CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_caches() -> str | None:
    """The data and unified caches the first CPU sees ("L1d 48K, L2 1024K, L3 32768K"), or None where
    sysfs lists none. A one-token step streams the weights: whether they fit in the last level decides
    its speed as much as the ISA does."""
    found = []
    for index in sorted(CPU_CACHE_DIR.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind == "Instruction":
            continue
        found.append((int(level) if level.isdigit() else 0, f"L{level}{'d' if kind == 'Data' else ''} {size}"))
    return ", ".join(text for _, text in sorted(found)) or None


def available_cpus() -> int:
    """Logical CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _nvidia_smi_gpus() -> tuple[tuple[str, ...], ...]:
    """One row per GPU ``nvidia-smi`` lists: name, driver, memory, compute capability; empty when
    it is missing, fails or lists none. Cached: asked by every provider check, and the answer does
    not change within a run."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        proc = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,compute_cap",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return ()
    if proc.returncode != 0:
        return ()
    rows = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return tuple(tuple(([p.strip() for p in row.split(",")] + [""] * 4)[:4]) for row in rows)


def gpu_names() -> tuple[str, ...]:
    """Names of the NVIDIA GPUs ``nvidia-smi`` lists; empty when it is missing, fails or lists none."""
    return tuple(row[0] for row in _nvidia_smi_gpus())


gpu_names.cache_clear = _nvidia_smi_gpus.cache_clear  # one nvidia-smi answer a run, cleared as one


def gpu_device_present() -> bool:
    """Whether an NVIDIA GPU is visible: nvidia-smi lists one, or the driver exposes a device node.

    The device-node check covers containers that pass a GPU through without nvidia-smi.
    """
    if gpu_names():
        return True
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


# The GPU libraries whose versions a GPU number depends on (onnxruntime-gpu's CUDA and TensorRT
# providers load them by soname at run time).
GPU_LIBRARY_DISTS = ("onnxruntime-gpu", "tensorrt", "tensorrt-cu13", "tensorrt-cu13-libs", "tensorrt-cu12",
                     "tensorrt-cu12-libs", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cublas",
                     "nvidia-cublas-cu12", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-curand",
                     "nvidia-curand-cu12")


def gpu_details() -> dict | None:
    """Each GPU's name, driver, memory and compute capability (nvidia-smi) and the installed GPU
    libraries' versions; None where no GPU is listed."""
    rows = _nvidia_smi_gpus()
    if not rows:
        return None
    gpus = [{"name": n, "driver": d, "memory": m, "compute_capability": c} for n, d, m, c in rows]
    libraries = {}
    for dist in GPU_LIBRARY_DISTS:
        try:
            libraries[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"gpus": gpus, "libraries": libraries}
